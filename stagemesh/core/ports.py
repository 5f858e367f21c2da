"""A free loopback (or host) port for a process to listen on later, chosen outside the kernel's ephemeral range.

A port-0 bind would hand out a port from that range, and any outbound connection (the mesh's own gRPC channels,
gloo, a test's client) may take it as its source port before the listener binds it: its start then fails, and
a restarted listener given the same port fails again for as long as that connection lives.
"""
from __future__ import annotations

import random
import socket
from pathlib import Path


def ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


_EPHEMERAL_LOW = ephemeral_low()
_GIVEN: set[int] = set()
TRIES = 500


def free_port(host: str = "127.0.0.1") -> int:
    """A port below the ephemeral range, not handed out before by this process, nothing bound to it now (a
    port-0 bind after TRIES misses)."""
    low = 20000 if _EPHEMERAL_LOW > 21000 else 1024
    for _ in range(TRIES):
        port = random.randrange(low, _EPHEMERAL_LOW)
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
