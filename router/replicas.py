"""The data-parallel replicas behind a router: clients, health, load."""
from __future__ import annotations

import asyncio
import logging
from collections import Counter
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from router.kv_index import KVFeed
from router.observe import kv_index_resync, kv_index_state, replica_state
from router.submit_stream import RequestStream, SubmitStream
from stagemesh.core.deadlines import DEADLINES
from stagemesh.core.engine_request import EngineRequest
from stagemesh.core.service_options import aio_channel
from stagemesh.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc

log = logging.getLogger("stagemesh.router")
STATS_DEADLINE_S = 2.0
WATCH_WINDOW_S = 60.0  # a WatchStats stream is re-opened this often (every call has a deadline)
SERVING = health_pb2.HealthCheckResponse.SERVING


@dataclass
class Replica:
    address: str
    healthy: bool = False
    reason: str = "not checked yet"
    num_running: int = 0
    num_waiting: int = 0
    dispatched: int = 0  # sent since the last stats poll
    max_model_len: int = 0
    eos_token_ids: tuple[int, ...] = ()
    served_model_name: str = ""
    scheduling_policy: str = ""  # its scheduler's --scheduling-policy (fcfs or priority)
    kv_role: str = "both"  # its scheduler's --kv-role: both, prefill or decode (disaggregated prefill)
    num_kv_blocks: int = 0  # its working KV pool (Stats), and its lower tiers (ModelInfo), for the KV index's cap
    num_host_kv_blocks: int = 0
    num_disk_kv_blocks: int = 0
    info_epoch: int = 0  # the pipeline epoch its ModelInfo was read at
    cordoned: bool = False  # told (router.control) to take no new request: it is about to drain
    # --enable-lora (Stats): its --max-loras, and the adapters its running requests use
    max_loras: int = 0
    running_adapters: frozenset[str] = frozenset()
    lora_reported: bool = False  # its stats said which adapters it serves (below), name -> directory
    lora_adapters: dict[str, str] = field(default_factory=dict)
    forgotten: bool = False  # no longer balanced over (ReplicaSet.set_replicas): a late check reports nothing
    # requests this router has there now, per tenant (router.replica_set.tenant_spread)
    tenants: Counter[str] = field(default_factory=Counter)
    queue_wait: dict[str, float] = field(default_factory=dict)  # tenant -> its oldest waiting request's wait there
    stub: scheduler_pb2_grpc.SchedulerStub = field(init=False, repr=False)  # (made in __post_init__)

    def __post_init__(self) -> None:
        self.channel = aio_channel(self.address)
        self.stub = scheduler_pb2_grpc.SchedulerStub(self.channel)
        self.health_stub = health_pb2_grpc.HealthStub(self.channel)
        self._stream: SubmitStream | None = None

    @property
    def load(self) -> int:
        return self.num_running + 4 * self.num_waiting + self.dispatched

    async def refresh(self) -> None:
        """The health check: grpc.health.v1 and the scheduler's own stats must both say it can serve."""
        try:
            check = await self.health_stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=STATS_DEADLINE_S)
            stats = await self.stub.GetStats(scheduler_pb2.GetStatsRequest(), timeout=STATS_DEADLINE_S)
            if stats.healthy and (not self.max_model_len or stats.epoch != self.info_epoch):  # (tiers resized)
                self.info_epoch = stats.epoch
                info = await self.stub.GetModelInfo(scheduler_pb2.GetModelInfoRequest(), timeout=STATS_DEADLINE_S)
                self.max_model_len, self.eos_token_ids = info.max_model_len, tuple(info.eos_token_ids)
                self.served_model_name = info.served_model_name
                self.scheduling_policy = info.scheduling_policy or "fcfs"
                self.kv_role = info.kv_role or "both"
                self.num_host_kv_blocks, self.num_disk_kv_blocks = info.num_host_kv_blocks, info.num_disk_kv_blocks
            serving = check.status == SERVING and stats.healthy
            reason = stats.unhealthy_reason or ("" if serving else "grpc.health.v1 reports NOT_SERVING")
            self._set_health(serving and bool(self.max_model_len), reason)
            self._set_load(stats)
        except grpc.aio.AioRpcError as err:
            self._set_health(False, f"{err.code().name}: {err.details()}")

    async def watch(self, interval_ms: int) -> None:
        """Follow the scheduler's WatchStats stream for fresh load figures between health checks."""
        while True:
            try:
                call = self.stub.WatchStats(scheduler_pb2.WatchStatsRequest(interval_ms=interval_ms),
                                            timeout=WATCH_WINDOW_S)
                async for stats in call:
                    self._set_load(stats)
                    if not stats.healthy:  # taken out at once; only the health check puts it back
                        self._set_health(False, stats.unhealthy_reason or "the scheduler reports unhealthy")
            except grpc.aio.AioRpcError as err:
                if err.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                    await asyncio.sleep(interval_ms / 1000)

    async def watch_kv_events(self, index) -> None:
        """Keep the replica's part of the KV index (router.kv_index) as its scheduler's KV events tell, checked
        (KVFeed): a gap, a new epoch without its snapshot, more blocks than the replica can hold, or a lost
        stream make the replica degraded (its hits count for nothing) and the router subscribes again, whose
        new stream begins with a snapshot; in sync again once that snapshot is in. While the stream is down
        the replica's part is empty (what it caches then is unknown)."""
        if index.mark_degraded(self.address, "not synced yet") is None:  # (the start: no warning)
            kv_index_state(self.address, True, index.num_blocks(self.address))
        while True:
            feed = KVFeed(index, self.address)
            reason = None
            try:
                call = self.stub.WatchKVEvents(scheduler_pb2.WatchKVEventsRequest(), timeout=WATCH_WINDOW_S)
                async for batch in call:
                    index.set_capacity(self.address, self.kv_capacity_blocks)
                    reason = feed.apply(batch)
                    if reason is not None:
                        call.cancel()
                        break
                    if feed.synced and index.mark_synced(self.address):
                        epoch, seq = index.positions.get(self.address, (0, 0))
                        log.info("KV index of replica %s is in sync: %d blocks (epoch %016x, seq %d)", self.address,
                                 index.num_blocks(self.address), epoch, seq)
                    kv_index_state(self.address, index.is_degraded(self.address), index.num_blocks(self.address))
                else:
                    reason = "stream_ended"  # (the scheduler ended it: this router fell too far behind)
            except grpc.aio.AioRpcError as err:
                if err.code() != grpc.StatusCode.DEADLINE_EXCEEDED:  # (a window's end: the next one resyncs)
                    reason = "stream_lost"
                    index.clear(self.address)
            if reason is not None:
                was = index.mark_degraded(self.address, reason)
                if was != reason:  # (not every retry against a replica that stays down)
                    kv_index_resync(self.address, reason)
                if was is None:
                    log.warning("KV index of replica %s is DEGRADED (%s): kv-aware routing counts no hit there "
                                "until a new snapshot is in", self.address, reason)
                kv_index_state(self.address, True, index.num_blocks(self.address))
                if reason in ("stream_lost", "overflow", "malformed"):
                    await asyncio.sleep(1.0)  # (not a busy loop against a replica that is down or misbehaves)

    @property
    def kv_capacity_blocks(self) -> int:
        """Blocks the replica can hold over every tier (0: unknown)."""
        return self.num_kv_blocks + self.num_host_kv_blocks + self.num_disk_kv_blocks

    def mark_failed(self, reason: str) -> None:
        """A request saw the replica fail: stop sending it work until a health check passes."""
        self._set_health(False, reason)

    def _set_load(self, stats) -> None:
        self.num_running, self.num_waiting, self.dispatched = stats.num_running, stats.num_waiting, 0
        self.num_kv_blocks = stats.num_kv_blocks
        self.max_loras, self.running_adapters = stats.max_loras, frozenset(stats.running_lora_adapters)
        self.lora_reported = stats.max_loras > 0
        self.lora_adapters = {a.name: a.path for a in stats.lora_adapters}
        self.queue_wait = dict(stats.tenant_queue_wait_seconds)
        if not self.forgotten:
            replica_state(self.address, self.healthy, stats)

    def _set_health(self, healthy: bool, reason: str) -> None:
        was, self.healthy, self.reason = self.healthy, healthy, reason
        if not self.forgotten:
            replica_state(self.address, healthy)
        if was != healthy:
            log.log(logging.INFO if healthy else logging.WARNING, "replica %s is now %s%s", self.address,
                    "healthy" if healthy else "UNHEALTHY", "" if healthy else f": {reason}")

    def submit(self, request: EngineRequest) -> RequestStream:
        """Send a request over the replica's SubmitStream (opened on first use, and again after it broke)."""
        self.dispatched += 1
        return self._submit_stream().submit(request)

    async def load_lora(self, name: str, path: str) -> None:
        """Its scheduler loads a LoRA adapter on every stage (router.lora_api); grpc.aio.AioRpcError says why not."""
        request = common_pb2.LoadLoRAAdapterRequest(adapter=common_pb2.LoRAAdapter(name=name, path=path))
        await self.stub.LoadLoRAAdapter(request, timeout=DEADLINES.lora_load_s)

    async def unload_lora(self, name: str) -> None:
        await self.stub.UnloadLoRAAdapter(common_pb2.UnloadLoRAAdapterRequest(name=name),
                                          timeout=DEADLINES.lora_load_s)

    async def release_kv(self, request_id: str) -> bool:
        """Disaggregated prefill: a prefilled request's KV held here goes unused (its client went away before a
        decode replica was given it, or a decode replica could not load it): free it now. Whether it was held."""
        try:
            reply = await self.stub.ReleaseKV(scheduler_pb2.ReleaseKVRequest(request_id=request_id),
                                              timeout=STATS_DEADLINE_S)
            return reply.released
        except grpc.aio.AioRpcError as err:  # its hold times out by itself
            log.warning("could not release the KV of request %s on replica %s: %s", request_id, self.address,
                        err.details())
            return False

    async def migrate(self, max_requests: int) -> int:
        """Rebalancing (router.rebalance): up to max_requests of its running requests handed on; how many were."""
        try:
            reply = await self.stub.Migrate(scheduler_pb2.MigrateRequest(max_requests=max_requests),
                                            timeout=STATS_DEADLINE_S)
            return reply.moved_with_kv + reply.moved_without_kv
        except grpc.aio.AioRpcError as err:  # (the next look tries again)
            log.warning("rebalancing: replica %s did not hand requests on: %s", self.address, err.details())
            return 0

    def attach(self, request_id: str, prompt: list[int], owner: str) -> RequestStream:
        """Attach a resumable request this replica may hold (its first update says whether it does)."""
        return self._submit_stream().attach(request_id, prompt, owner)

    def _submit_stream(self) -> SubmitStream:
        if self._stream is None or self._stream.closed:
            self._stream = SubmitStream(self.stub, self.address)
        return self._stream

    def detach(self) -> None:
        """This router stops with requests still running here: leave them to the replica (aborting none), which
        keeps the resumable ones for another router."""
        if self._stream is not None:
            self._stream.detaching = True

    async def close(self) -> None:
        if self._stream is not None:
            self._stream.close()
        await self.channel.close()
