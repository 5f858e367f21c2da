"""serve's own calls to its children: a scheduler's readiness and load, a router's readiness and its replicas.
Every call has a deadline and carries the mesh's internal token (and TLS when the mesh runs with it); a child
that does not answer reads as not ready."""
from __future__ import annotations

import threading
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from stagemesh.core.internal_token import SyncClientInterceptor
from stagemesh.core.service_options import RECONNECT_OPTIONS, channel_credentials
from stagemesh.v1 import router_pb2, router_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc

DEADLINE_S = 2.0
SERVING = health_pb2.HealthCheckResponse.SERVING


@dataclass(frozen=True)
class SchedulerView:
    """A replica's scheduler as one look saw it."""
    serving: bool  # grpc.health.v1 "" SERVING: its pipeline is formed and it takes new requests
    epoch: int  # its pipeline's epoch (a new one each time it forms)
    num_running: int
    num_waiting: int
    kv_cache_usage: float


class MeshRPC:
    def __init__(self, token: str):
        self.token = token
        self._channels: dict[str, grpc.Channel] = {}
        self._lock = threading.Lock()

    def _channel(self, address: str) -> grpc.Channel:
        with self._lock:
            chan = self._channels.get(address)
            if chan is None:
                creds = channel_credentials()
                raw = grpc.insecure_channel(address, RECONNECT_OPTIONS) if creds is None else \
                    grpc.secure_channel(address, creds, RECONNECT_OPTIONS)
                chan = self._channels[address] = grpc.intercept_channel(raw, SyncClientInterceptor(self.token))
            return chan

    def _serving(self, address: str) -> bool:
        check = health_pb2_grpc.HealthStub(self._channel(address)).Check(health_pb2.HealthCheckRequest(service=""),
                                                                         timeout=DEADLINE_S)
        return check.status == SERVING

    def scheduler(self, address: str) -> SchedulerView | None:
        """None: it does not answer."""
        try:
            serving = self._serving(address)
            s = scheduler_pb2_grpc.SchedulerStub(self._channel(address)).GetStats(scheduler_pb2.GetStatsRequest(),
                                                                                  timeout=DEADLINE_S)
        except grpc.RpcError:
            return None
        return SchedulerView(serving and s.healthy, s.epoch, s.num_running, s.num_waiting, s.kv_cache_usage)

    def router_ready(self, control: str) -> bool:
        """The router's readiness (its /ready), on its own control port."""
        try:
            return self._serving(control)
        except grpc.RpcError:
            return False

    def router_sees(self, control: str) -> dict[str, bool] | None:
        """replica address -> whether the router finds it healthy (and not cordoned); None: no answer."""
        try:
            reply = router_pb2_grpc.RouterControlStub(self._channel(control)).GetReplicas(
                router_pb2.GetReplicasRequest(), timeout=DEADLINE_S)
        except grpc.RpcError:
            return None
        return {r.address: r.healthy and not r.cordoned for r in reply.replicas}

    def set_replicas(self, control: str, wanted: dict[str, bool]) -> bool:
        """Tell a router its replicas (address -> cordoned); whether it took them."""
        request = router_pb2.SetReplicasRequest(replicas=[router_pb2.ReplicaEntry(address=a, cordoned=c)
                                                          for a, c in wanted.items()])
        try:
            router_pb2_grpc.RouterControlStub(self._channel(control)).SetReplicas(request, timeout=DEADLINE_S)
        except grpc.RpcError:
            return False
        return True

    def reload_api_keys(self, control: str) -> tuple[bool, str]:
        """Have a router read its --api-keys-file again: (whether it did, what it holds now or why not)."""
        try:
            reply = router_pb2_grpc.RouterControlStub(self._channel(control)).ReloadApiKeys(
                router_pb2.ReloadApiKeysRequest(), timeout=DEADLINE_S)
        except grpc.RpcError as err:
            return False, err.details() or str(err.code())
        return True, reply.tenants

    def forget(self, address: str) -> None:
        with self._lock:
            chan = self._channels.pop(address, None)
        if chan is not None:
            chan.close()

    def close(self) -> None:
        with self._lock:
            channels, self._channels = list(self._channels.values()), {}
        for chan in channels:
            chan.close()
