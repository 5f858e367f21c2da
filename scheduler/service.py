"""The scheduler's gRPC service (asyncio): decode, hand off to the Driver, encode."""
from __future__ import annotations

import asyncio
import logging
from dataclasses import replace

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from scheduler.connection import Connection
from scheduler.drain import Drain
from scheduler.driver import Driver, Unavailable
from scheduler.kv_peers import KVPeers
from scheduler.kv_transfer import KVLoadFailed, check_kv_source, failure_message
from scheduler.lora_admin import AdapterExists, AdapterInUse, AdapterUnknown, LoRAAdmin
from scheduler.rendezvous import ModelIdentity, StageInfo
from scheduler.replies import fill_update, kv_batch_to_pbs, status_of
from scheduler.request import RequestOutput
from scheduler.sessions import Sessions
from stagemesh.core.engine_request import EngineRequest, KVSourceInfo
from stagemesh.core.errors import StagemeshError
from stagemesh.core.grpc_errors import ErrorInterceptor
from stagemesh.core import kv_ticket
from stagemesh.core.hash_parts import tier_parts
from stagemesh.core.kv_groups import FULL
from stagemesh.core.health import LIVENESS, follow
from stagemesh.core.lora import LoRAError
from stagemesh.core.service_options import add_port, aio_server
from stagemesh.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc, stage_pb2
from stagemesh.core.wire import engine_request_from_pb

log = logging.getLogger("stagemesh.scheduler")
MIGRATE_WAIT_S = 1.0  # a rebalance waits this long for a point between two steps (within the caller's deadline)
SERVICE = "stagemesh.v1.Scheduler"


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(self, driver: Driver, served_model_name: str, model_path: str, vocab_size: int,
                 kv_role: str = "both", resume_grace_s: float = 30.0, kv_peers: KVPeers | None = None):
        self.driver = driver
        self.kv_peers = kv_peers or KVPeers(())  # the prefill replicas whose KV this one may fetch (--kv-peer)
        self.sessions = Sessions(driver, resume_grace_s)  # resumable requests (scheduler.sessions)
        self.drain = Drain()  # why no new request is taken, while the replica serves the ones it has
        self.served_model_name, self.model_path, self.vocab_size = served_model_name, model_path, vocab_size
        self.kv_role = kv_role
        self.address = ""  # host:port other replicas reach this one at (set once the port is bound)
        self.block_size = driver.status().block_size  # the pipeline's, fixed
        # --enable-lora: the replica's adapters, loaded and unloaded at run time too
        self.lora = LoRAAdmin(driver.cfg.scheduler.lora, driver.pipeline, self._requests)

    def _requests(self) -> list:
        scheduler = self.driver.scheduler
        return list(scheduler.requests.values()) if scheduler is not None else []

    def _lora_pbs(self) -> list[common_pb2.LoRAAdapter]:
        table = self.lora.table
        return [] if table is None else [common_pb2.LoRAAdapter(name=n, path=p) for n, p in table.adapters.items()]

    async def SubmitStream(self, request_iterator, context):
        """The writer: one message per take of everything pending; a task of its own reads the actions."""
        connection = Connection()
        reader = asyncio.create_task(self._read_actions(request_iterator, connection))
        try:
            while not connection.closed:
                updates = await connection.take()
                if updates:
                    reply = scheduler_pb2.SubmitStreamResponse()
                    for update in updates:
                        fill_update(reply.updates.add(), update, self._kv_params)
                    yield reply
        finally:
            reader.cancel()
            kept = self.sessions.detach(connection)  # resumable: kept for a router to attach them
            for request_id in list(connection.running):  # the client went away: free their blocks now
                if request_id not in kept:
                    self.driver.release(request_id)

    async def _read_actions(self, request_iterator, connection: Connection) -> None:
        try:
            async for request in request_iterator:
                for submit in request.submits:
                    self._add(submit, connection)
                for attach in request.attaches:
                    self._attach(attach, connection)
                for request_id in request.abort_request_ids:
                    if self.sessions.stop(request_id, connection):
                        continue
                    if request_id in connection.running:
                        connection.forget(request_id)
                        self.driver.release(request_id)
                for request_id in request.release_request_ids:
                    self.sessions.release(request_id, connection)
        except grpc.aio.AioRpcError as err:
            log.debug("a submit stream broke: %s", err)
        except Exception:  # a bug, or a client that breaks the protocol: end the stream, freeing its requests
            log.exception("reading a submit stream failed")
        finally:
            connection.close()

    def _add(self, submit, connection: Connection) -> None:
        try:
            r = engine_request_from_pb(submit)  # (its sampling checked: a bad value fails the request alone)
            if self.drain.reason:
                raise Unavailable(f"the replica takes no new requests: {self.drain.reason}")
            if r.kv_source is not None:
                r = replace(r, kv_source=self._usable_kv_source(r))
            sink = self._sink(r, connection)
            try:
                self.driver.add(r, sink)
            except StagemeshError:
                if r.resumable:  # (the session just opened for it)
                    self.sessions.drop(r.request_id)
                raise
        except StagemeshError as err:
            connection.reject(submit.request.request_id, err)
            return
        connection.added(r.request_id)

    def _usable_kv_source(self, r: EngineRequest) -> KVSourceInfo | None:
        """A decode request's kv_source, checked; None: the prompt is computed here (its own prefill, held here,
        is freed: a decode replica was not to be had; or a source that is not a --kv-peer, under the
        kv_load_failure_policy recompute). Raises KVLoadFailed for that source under fail."""
        assert r.kv_source is not None  # (called only for a request that has one)
        kv_source = check_kv_source(r.kv_source)
        if kv_source.scheduler_address == self.address:
            self.driver.release_kv(kv_source.request_id)
            return None
        if self.kv_peers.knows(kv_source.scheduler_address):
            return kv_source
        why = f"its kv_transfer names the scheduler {kv_source.scheduler_address:.200}, which is not a " \
              "--kv-peer of this replica"
        if self.driver.cfg.scheduler.kv_load_failure_policy == "fail":  # (never dialled, not even to release)
            self.driver.observer.kv_load_refused("not_peer", "fail")
            log.warning("request %s: %s: the request fails (kv_load_failure_policy fail)", r.request_id, why)
            raise KVLoadFailed(failure_message(r.request_id, kv_source.scheduler_address, "not_peer",
                                               "not a --kv-peer of this replica"))
        self.driver.observer.kv_load_refused("not_peer", "recompute")
        log.warning("request %s: %s: computing the prompt here", r.request_id, why)
        return None

    def _sink(self, r: EngineRequest, connection: Connection):
        """Where a new request's outputs go: its connection, or for a resumable one a session that keeps them."""
        if r.resumable:
            return self.sessions.open(r, connection)
        if r.request_id in self.sessions:
            raise StagemeshError(f"request id {r.request_id!r} is already in use (by a resumable request)")
        return connection

    def _attach(self, attach, connection: Connection) -> None:
        try:
            self.sessions.attach(attach.request_id, list(attach.prompt_token_ids), attach.owner, connection)
        except StagemeshError as err:
            connection.reject(attach.request_id, err)

    async def Abort(self, request, context):
        return scheduler_pb2.AbortResponse(num_aborted=self.driver.abort(list(request.request_ids)))

    def _stats(self) -> scheduler_pb2.Stats:
        d = self.driver.status()
        # healthy: it takes new requests (routers send it work); a draining replica still serves its own
        stats = scheduler_pb2.Stats(healthy=self.ready(), unhealthy_reason=d.reason or self.drain.reason,
                                    max_waiting_requests=d.max_waiting_requests, num_steps=d.num_steps,
                                    step_seconds_total=d.step_seconds, stage_compute_seconds_total=d.compute_seconds,
                                    epoch=d.epoch)
        if self.lora.table is not None:  # what the routers learn the replica's adapters from
            stats.max_loras = self.lora.table.max_loras
            stats.lora_adapters.extend(self._lora_pbs())
        if d.scheduler is not None:
            s = d.scheduler
            stats.num_running, stats.num_waiting, stats.kv_cache_usage = s.num_running, s.num_waiting, s.kv_cache_usage
            stats.prefix_cache_queries, stats.prefix_cache_hits = s.prefix_cache_queries, s.prefix_cache_hits
            stats.num_kv_blocks, stats.num_preemptions = s.num_kv_blocks, s.num_preemptions
            stats.tenant_queue_wait_seconds.update(s.queue_wait)
            if self.lora.table is not None:
                stats.running_lora_adapters.extend(s.running_adapters)
                stats.waiting_lora_adapters.extend(s.waiting_adapters)
            if s.spec_decode is not None:
                spec = s.spec_decode
                stats.spec_decode_num_drafts, stats.spec_decode_num_draft_tokens = spec.num_drafts, \
                    spec.num_draft_tokens
                stats.spec_decode_num_accepted_tokens = spec.num_accepted_tokens
                stats.spec_decode_num_accepted_tokens_per_pos.extend(spec.accepted_per_pos)
        return stats

    def ready(self) -> bool:
        """Readiness: the pipeline is formed and the replica is not draining."""
        return self.driver.healthy and not self.drain.reason  # (polled: not the whole status)

    def unfinished(self) -> int:
        """Requests it runs, keeps for a resume, or whose KV it holds for another replica (a drain, its stages'
        too, waits for none to be left)."""
        scheduler = self.driver.scheduler
        return (scheduler.num_unfinished if scheduler is not None else 0) + self.sessions.num_kept + \
            self.driver.holds_kv()

    async def GetStats(self, request, context):
        return self._stats()

    async def WatchStats(self, request, context):
        interval = max(request.interval_ms, 50) / 1000
        while True:
            yield self._stats()
            await asyncio.sleep(interval)

    async def WatchKVEvents(self, request, context):
        queue = self.driver.subscribe_kv_events()
        try:
            while (batch := await queue.get()) is not None:
                for message in kv_batch_to_pbs(batch, self.block_size):
                    yield message
        finally:
            self.driver.unsubscribe_kv_events(queue)

    async def GetKVSnapshot(self, request, context):
        epoch, seq, tiers = self.driver.kv_events.snapshot()
        parts = list(tier_parts(tiers))
        for i, part in enumerate(parts):
            yield scheduler_pb2.KVSnapshot(epoch=epoch, seq=seq, block_size=self.block_size, more=i < len(parts) - 1,
                                           tiers=[scheduler_pb2.KVSnapshotTier(medium=medium, block_hashes=hashes)
                                                  for medium, hashes in part])

    async def GetModelInfo(self, request, context):
        d = self.driver.status()
        info = scheduler_pb2.ModelInfo(served_model_name=self.served_model_name, model_path=self.model_path,
                                       vocab_size=self.vocab_size, eos_token_ids=d.eos_token_ids,
                                       block_size=d.block_size, pipeline_parallel_size=d.num_stages,
                                       scheduling_policy=d.scheduling_policy, kv_role=self.kv_role)
        if d.stages and d.healthy:
            info.max_model_len = d.max_model_len
            info.tensor_parallel_sizes.extend(d.tp_sizes)
            info.kv_cache_tokens = d.kv_cache_tokens
            info.stages.extend(stage_pb2.KVSource(address=x.address, layer_start=x.layer_start,
                                                  layer_end=x.layer_end) for x in d.stages)
        scheduler = self.driver.scheduler
        tiers = scheduler.kv.tiers if scheduler is not None else None
        if tiers is not None:  # (what a router's KV index of this replica may hold: its bound)
            info.num_host_kv_blocks, info.num_disk_kv_blocks = tiers.num_host_blocks, tiers.num_disk_blocks
        return info

    async def ReleaseKV(self, request, context):
        return scheduler_pb2.ReleaseKVResponse(released=self.driver.release_kv(request.request_id))

    async def Migrate(self, request, context):
        if request.max_requests < 1:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"max_requests must be at least 1, got {request.max_requests}")
        if self.drain.reason:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"the replica drains: {self.drain.reason}")
        with_kv, without = await self.driver.migrate_some(request.max_requests, MIGRATE_WAIT_S)
        if with_kv or without:
            log.info("rebalance: %d running request(s) handed on (%d with their KV), as a router asked",
                     with_kv + without, with_kv)
        return scheduler_pb2.MigrateResponse(moved_with_kv=with_kv, moved_without_kv=without)

    async def GetKVPeers(self, request, context):
        return scheduler_pb2.GetKVPeersResponse(stage_addresses=sorted(await self.kv_peers.stage_addresses()))

    def _kv_params(self, out: RequestOutput) -> KVSourceInfo:
        held = out.held_kv
        assert held is not None  # (called only for an output that holds KV: scheduler.replies)
        return KVSourceInfo(self.address, out.request_id, held.epoch, tuple(held.block_ids), self.block_size,
                            held.num_tokens, held.stages,
                            kv_ticket.ticket(self.driver.pipeline.kv_read_key, held.epoch, held.block_ids))

    async def RegisterStage(self, request, context):
        s = request.stage
        m = s.model
        info = StageInfo(s.stage_index, s.layer_start, s.layer_end, s.tensor_parallel_size, s.device, s.num_kv_blocks,
                         s.block_size, ModelIdentity(m.model_type, m.num_hidden_layers, m.hidden_size, m.vocab_size,
                                                     m.num_attention_heads, m.num_key_value_heads), s.address,
                         s.handoff, s.instance_id, s.standby, s.num_speculative_tokens, s.kv_bytes_per_block,
                         s.kv_disk_tier, tuple(s.lora_adapters), s.max_loras, tuple(s.pooling_tasks),
                         s.kv_cache_dtype or "auto", tuple(s.kv_group_windows) or (FULL,))
        if self.lora.table is not None and self.lora.table.lacking(info.lora_adapters):
            # not part of the pipeline yet: it reads the adapters it lacks and registers again
            return scheduler_pb2.RegisterStageResponse(num_missing_stages=self.driver.status().num_stages,
                                                       lora_adapters=self._lora_pbs())
        try:
            missing, first_seen = await self.driver.register_stage(info)
            self.drain.stage(s.stage_index, s.instance_id, s.draining)
        except StagemeshError as err:  # a stage that does not fit this pipeline: its state, not a bad argument
            log.error("refused a stage: %s", err)
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(err))
        if first_seen:
            log.info("stage %d registered: layers %d:%d, %d rank(s), at %s (%d missing)", s.stage_index, s.layer_start,
                     s.layer_end, s.tensor_parallel_size, s.address, missing)
        return scheduler_pb2.RegisterStageResponse(num_missing_stages=missing, first_seen=first_seen,
                                                   num_unfinished_requests=self.unfinished(),
                                                   lora_adapters=self._lora_pbs())

    async def LoadLoRAAdapter(self, request, context):
        try:
            await self.lora.load(request.adapter.name, request.adapter.path)
        except LoRAError as err:
            await context.abort(_LORA_STATUS.get(type(err), grpc.StatusCode.INVALID_ARGUMENT), str(err))
        return common_pb2.LoadLoRAAdapterResponse()

    async def UnloadLoRAAdapter(self, request, context):
        try:
            await self.lora.unload(request.name)
        except LoRAError as err:
            await context.abort(_LORA_STATUS.get(type(err), grpc.StatusCode.INVALID_ARGUMENT), str(err))
        return common_pb2.UnloadLoRAAdapterResponse()


_LORA_STATUS = {AdapterExists: grpc.StatusCode.ALREADY_EXISTS, AdapterUnknown: grpc.StatusCode.NOT_FOUND,
                AdapterInUse: grpc.StatusCode.FAILED_PRECONDITION}


async def serve(servicer: SchedulerServicer, host: str, port: int) -> tuple[grpc.aio.Server, int]:
    server = aio_server([("grpc.max_receive_message_length", 64 * 2**20)], ErrorInterceptor(status_of, log))
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    bound = add_port(server, f"{host}:{port}")
    if bound == 0:
        raise StagemeshError(f"cannot listen on {host}:{port}")
    await server.start()
    servicer.driver.spawn(follow(health_servicer, (SERVICE,), servicer.ready))
    await health_servicer.set(LIVENESS, health_pb2.HealthCheckResponse.SERVING)
    servicer.driver.spawn(servicer.sessions.sweep_loop())
    return server, bound


