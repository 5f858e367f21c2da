"""The router's control port (stagemesh.v1.RouterControl): the mesh's supervisor changes the replicas the router
balances over while it serves (runtime scaling), and reads this one router's readiness (grpc.health.v1 "") on a
port of its own, where the HTTP port may be shared by several routers (SO_REUSEPORT).

Loopback only, and every call but health needs the mesh's internal token: a router started with --control-port
and no token refuses to start."""
from __future__ import annotations

import asyncio
import logging
from typing import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from router.replica_set import ReplicaSet
from stagemesh.core import internal_token
from stagemesh.core.errors import StagemeshError
from stagemesh.core.grpc_errors import ErrorInterceptor, by_type
from stagemesh.core.hash_parts import tier_parts
from stagemesh.core.health import LIVENESS, follow
from stagemesh.core.service_options import add_port, aio_server
from stagemesh.v1 import router_pb2, router_pb2_grpc

log = logging.getLogger("stagemesh.router")
CONTROL_HOST = "127.0.0.1"
MAX_REPLICAS = 1024
MAX_ADDRESS_LEN = 255
SERVICE = "stagemesh.v1.RouterControl"


def checked_replicas(request: router_pb2.SetReplicasRequest) -> dict[str, bool]:
    """address -> cordoned; StagemeshError (INVALID_ARGUMENT) for a list no router can take."""
    entries = list(request.replicas)
    if not 0 < len(entries) <= MAX_REPLICAS:
        raise StagemeshError(f"SetReplicas needs 1 to {MAX_REPLICAS} replicas (got {len(entries)})")
    wanted: dict[str, bool] = {}
    for e in entries:
        host, _, port = e.address.rpartition(":")
        if not host or not port.isdigit() or len(e.address) > MAX_ADDRESS_LEN or not e.address.isprintable():
            raise StagemeshError(f"replica address {e.address[:MAX_ADDRESS_LEN]!r} is not HOST:PORT")
        if e.address in wanted:
            raise StagemeshError(f"replica {e.address} is listed twice")
        wanted[e.address] = e.cordoned
    return wanted


class RouterControlServicer(router_pb2_grpc.RouterControlServicer):
    def __init__(self, replicas: ReplicaSet):
        self.replicas = replicas

    async def SetReplicas(self, request, context):
        added, removed = await self.replicas.set_replicas(checked_replicas(request))
        return router_pb2.SetReplicasResponse(added=added, removed=removed)

    async def GetReplicas(self, request, context):
        return router_pb2.GetReplicasResponse(replicas=[
            router_pb2.ReplicaState(address=r.address, healthy=r.healthy, cordoned=r.cordoned, reason=r.reason,
                                    num_running=r.num_running, num_waiting=r.num_waiting)
            for r in self.replicas.replicas])

    async def GetKVIndex(self, request, context):
        index = getattr(self.replicas.policy, "index", None)
        if index is None or request.replica not in {r.address for r in self.replicas.replicas}:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no KV index of replica {request.replica[:255]!r} "
                                "(not a replica of this router, or its --policy is not kv-aware)")
            return
        epoch, seq = index.positions.get(request.replica, (0, 0))
        reason = index.degraded.get(request.replica, "")
        parts = list(tier_parts(sorted(index.tiers(request.replica).items())))
        for i, part in enumerate(parts):
            yield router_pb2.KVIndexState(degraded=bool(reason), reason=reason, epoch=epoch, seq=seq,
                                          more=i < len(parts) - 1, tiers=[
                                              router_pb2.KVIndexTier(medium=medium, block_hashes=hashes)
                                              for medium, hashes in part])


async def serve_control(replicas: ReplicaSet, port: int, ready: Callable[[], bool]
                        ) -> tuple[grpc.aio.Server, int, asyncio.Task]:
    """The control server on loopback; its health "" follows ready() (the router's /ready)."""
    if internal_token.token() is None:
        raise StagemeshError("--control-port needs the mesh's internal token (--internal-token-file or "
                             f"${internal_token.ENV}): without it anyone on this host could change the replicas")
    server = aio_server(errors=ErrorInterceptor(by_type((StagemeshError, grpc.StatusCode.INVALID_ARGUMENT)), log))
    router_pb2_grpc.add_RouterControlServicer_to_server(RouterControlServicer(replicas), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    bound = add_port(server, f"{CONTROL_HOST}:{port}")
    if bound == 0:
        raise StagemeshError(f"--control-port {port}: cannot listen on {CONTROL_HOST}")
    await server.start()
    await health_servicer.set(LIVENESS, health_pb2.HealthCheckResponse.SERVING)
    return server, bound, asyncio.create_task(follow(health_servicer, (SERVICE,), ready, interval_s=0.2))
