"""grpc.health.v1 status that follows a service's own idea of being able to serve."""
from __future__ import annotations

import asyncio
from typing import Callable

from grpc_health.v1 import health_pb2


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
