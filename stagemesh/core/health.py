"""grpc.health.v1 status that follows a service's own idea of being able to serve.

Every service answers two names: "" (and its own service name) is readiness, SERVING while it takes new work;
LIVENESS is SERVING for as long as the process runs, for a liveness probe that must not restart a service only
because what it depends on is down."""
from __future__ import annotations

import asyncio
from typing import Callable

from grpc_health.v1 import health_pb2

LIVENESS = "liveness"


async def follow(servicer, services: tuple[str, ...], serving: Callable[[], bool], interval_s: float = 0.2) -> None:
    """Keep `services` (and the server-wide "") SERVING exactly while serving() holds."""
    last = None
    while True:
        status = health_pb2.HealthCheckResponse.SERVING if serving() else health_pb2.HealthCheckResponse.NOT_SERVING
        if status != last:
            for name in ("", *services):
                await servicer.set(name, status)
            last = status
        await asyncio.sleep(interval_s)
