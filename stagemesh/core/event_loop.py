"""The services' event loops: uvloop where it is installed (a dependency on Linux and macOS), asyncio's own
elsewhere.

The router and the scheduler spend most of their CPU in the event loop's machinery (callbacks, futures,
timers, socket writes) between gRPC and HTTP messages; uvloop runs that machinery in C, as vLLM's API server
does. benchmarks/bench_control_plane.py measures what it saves per token.
"""
from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

try:
    import uvloop
except ImportError:  # (Windows: uvloop does not build there)
    uvloop = None  # type: ignore[assignment]


def run(main: Coroutine[Any, Any, T]) -> T:
    """asyncio.run on the fastest loop at hand."""
    return asyncio.run(main) if uvloop is None else uvloop.run(main)


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A loop for a thread of its own (a stage's gRPC server)."""
    return uvloop.new_event_loop() if uvloop is not None else asyncio.new_event_loop()


def name() -> str:
    return "uvloop" if uvloop is not None else "asyncio"
