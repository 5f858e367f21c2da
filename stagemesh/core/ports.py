"""A free loopback (or host) port for a process to listen on later, chosen outside the kernel's ephemeral range.

A port-0 bind would hand out a port from that range, and any outbound connection (the mesh's own gRPC channels,
gloo, a test's client) may take it as its source port before the listener binds it: its start then fails, and
a restarted listener given the same port fails again for as long as that connection lives.

STAGEMESH_PORT_RANGE=LOW-HIGH narrows where it looks to [LOW, HIGH): meshes that start side by side on one host
(the test suite's workers) each take their own range, so that none picks a port another has picked and not yet
bound.
"""
from __future__ import annotations

import os
import random
import socket
from pathlib import Path

from stagemesh.core.errors import StagemeshError

RANGE_ENV = "STAGEMESH_PORT_RANGE"


def ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


_EPHEMERAL_LOW = ephemeral_low()
_GIVEN: set[int] = set()
TRIES = 500


def port_range() -> tuple[int, int]:
    """[low, high) of the ports free_port hands out: STAGEMESH_PORT_RANGE's, else from 20000 (1024 where the
    ephemeral range starts below 21000) to the start of the ephemeral range."""
    value = os.environ.get(RANGE_ENV)
    if not value:
        return (20000 if _EPHEMERAL_LOW > 21000 else 1024), _EPHEMERAL_LOW
    try:
        low, high = (int(part) for part in value.split("-"))
    except ValueError:
        low = high = 0
    if not 1 <= low < high <= 65536:
        raise StagemeshError(f"{RANGE_ENV}={value!r}: give LOW-HIGH, two port numbers with LOW < HIGH <= 65536 "
                             "(the ports from LOW up to, not including, HIGH)")
    return low, high


def free_port(host: str = "127.0.0.1") -> int:
    """A port of port_range() (below the ephemeral range unless STAGEMESH_PORT_RANGE says otherwise), not handed
    out before by this process, nothing bound to it now (a port-0 bind after TRIES misses)."""
    low, high = port_range()
    for _ in range(TRIES):
        port = random.randrange(low, high)
        if port in _GIVEN:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        _GIVEN.add(port)
        return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
