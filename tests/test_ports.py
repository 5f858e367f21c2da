"""The ports the mesh picks for its listeners (stagemesh.core.ports): below the ephemeral range, never one handed out
before by the process, and within STAGEMESH_PORT_RANGE where it is given; a malformed range is refused by name."""
from __future__ import annotations

import socket

import pytest

from stagemesh.core import ports
from stagemesh.core.errors import StagemeshError


def test_the_default_range_ends_where_the_ephemeral_range_starts(monkeypatch):
    monkeypatch.delenv(ports.RANGE_ENV, raising=False)
    low, high = ports.port_range()
    assert high == ports.ephemeral_low() and 1024 <= low < high
    assert all(low <= ports.free_port() < high for _ in range(20))


def test_a_given_range_is_kept_and_no_port_is_handed_out_twice(monkeypatch):
    low = ports.free_port() // 200 * 200  # 200 ports below the ephemeral range
    monkeypatch.setenv(ports.RANGE_ENV, f"{low}-{low + 200}")
    assert ports.port_range() == (low, low + 200)
    with socket.socket() as held:  # a port something listens on is never handed out
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        held.bind(("127.0.0.1", ports.free_port()))
        held.listen()
        taken = held.getsockname()[1]
        got = [ports.free_port() for _ in range(50)]
    assert all(low <= port < low + 200 for port in [taken, *got]), got
    assert len(set(got)) == 50 and taken not in got


@pytest.mark.parametrize("value", ["abc", "3000", "3000-3000", "4000-3000", "0-10", "3000-70000", "1-2-3"])
def test_a_malformed_range_is_refused_naming_the_variable(monkeypatch, value):
    monkeypatch.setenv(ports.RANGE_ENV, value)
    with pytest.raises(StagemeshError, match=f"STAGEMESH_PORT_RANGE='{value}': give LOW-HIGH"):
        ports.free_port()
