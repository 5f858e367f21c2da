"""The stage's gRPC service (asyncio, on a thread of its own): decode, submit, encode.

Steps go to the stage's step executor (stage_worker.step_executor), which puts them in
order and runs them on the process's main thread; this service only awaits them.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from stagemesh.core import event_loop
from stagemesh.core.errors import StagemeshError
from stagemesh.core.grpc_errors import ErrorInterceptor, by_type
from stagemesh.core.health import LIVENESS
from stagemesh.core.lora import LoRAError, check_adapter_name
from stagemesh.core.sampling_params import InvalidParameter
from stagemesh.core.service_options import add_port, aio_server
from stagemesh.core.step_wire import epoch_from_pb, sampled_to_pb, step_from_pb
from stagemesh.core.wire import sampling_from_pb
from stagemesh.v1 import common_pb2, stage_pb2, stage_pb2_grpc
from stage_worker import kv_connector
from stage_worker.observe import ForwardObserver
from stage_worker.ep_group import EPGroupBroken
from stage_worker.kv_cache import kv_cache_dtype_name
from stage_worker.validate import InvalidStep, check_activations, check_tokens
from stage_worker.worker import StageWorker

log = logging.getLogger("stagemesh.stage")
SERVICE = "stagemesh.v1.Stage"


class StageServicer(stage_pb2_grpc.StageServicer):
    def __init__(self, worker: StageWorker, address: str, kv_peers: kv_connector.PeerStages):
        self.worker, self.steps = worker, worker.steps
        self.address = address
        self.kv_peers = kv_peers  # where PullKV may read from: what its scheduler says
        self.draining = False  # told to stop: its replica takes no new work until it is replaced
        c, s = worker.cfg, worker.cfg.settings
        self.observer = ForwardObserver(c.stage_index, s.layer_start, s.layer_end, s.tensor_parallel_size, c.handoff)

    def describe(self) -> stage_pb2.StageDescription:
        w, c, s, cfg = self.worker, self.worker.cfg, self.worker.cfg.settings, self.worker.runner.config
        return stage_pb2.StageDescription(
            stage_index=c.stage_index, layer_start=s.layer_start, layer_end=s.layer_end, tensor_parallel_size=s.ranks,
            device=s.device, free_memory_bytes=w.free_memory_bytes(), num_kv_blocks=w.num_kv_blocks,
            block_size=s.block_size, address=self.address, handoff=c.handoff, model_path=str(s.model_dir),
            weight_bytes=w.runner.model.num_parameter_bytes(), instance_id=w.instance_id, standby=c.standby,
            num_speculative_tokens=c.speculative.num_speculative_tokens if c.speculative else 0,
            speculative_model=c.speculative.model if c.speculative else "", draining=self.draining,
            kv_bytes_per_block=w.kv_bytes_per_block, kv_disk_tier=w.disk_dir is not None,
            kv_cache_dtype=kv_cache_dtype_name(w.runner.kv_cache_dtype),
            kv_group_windows=list(w.runner.kv_groups.windows),
            lora_adapters=list(w.runner.lora.modules) if w.runner.lora else [],
            max_loras=w.runner.lora.limits.max_loras if w.runner.lora else 0, pooling_tasks=w.runner.pooling_tasks,
            model=stage_pb2.ModelIdentity(model_type=cfg.model_type, num_hidden_layers=cfg.num_hidden_layers,
                                          hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size,
                                          num_attention_heads=cfg.num_attention_heads,
                                          num_key_value_heads=cfg.num_key_value_heads))

    async def Describe(self, request, context):
        return self.describe()

    async def JoinPipeline(self, request, context):
        spec = epoch_from_pb(request)
        try:  # a refused join leaves the epoch as it was; a plan the stage refuses is the caller's bad argument
            self.worker.check_join(spec)
        except EPGroupBroken as err:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(err))
        except StagemeshError as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        await self.steps.join(spec, self.worker.join)  # a failure is reported to the caller, the stage stays up
        hashes = await asyncio.to_thread(self.worker.disk_block_hashes)
        return stage_pb2.JoinPipelineResponse(disk_block_hashes=hashes)

    async def Forward(self, request, context):
        return await self._observed(request, context.invocation_metadata())

    async def ForwardStream(self, request_iterator, context):
        """Steps over one stream (the scheduler's step path): each answered with its step id when it ends; a
        step that fails ends the stream, raising what Forward would have raised (ERRORS maps it alike)."""
        replies: asyncio.Queue = asyncio.Queue()
        steps: set[asyncio.Task] = set()

        async def step(request) -> None:
            trace = [("traceparent", request.traceparent), ("tracestate", request.tracestate)] \
                if request.traceparent else None
            try:
                reply = await self._observed(request, trace)
                reply.step_id = request.step.step_id
                replies.put_nowait(reply)
            except Exception as err:  # noqa: BLE001 - raised where the stream is written
                replies.put_nowait(err)

        async def read() -> None:
            try:
                async for request in request_iterator:  # steps run side by side, as Forward calls do
                    task = asyncio.create_task(step(request))
                    steps.add(task)
                    task.add_done_callback(steps.discard)
            except Exception as err:  # noqa: BLE001 - the stream broke: it ends with that
                replies.put_nowait(err)
                return
            await asyncio.gather(*steps)  # the scheduler ended its side: the steps it sent still answer
            replies.put_nowait(None)

        reader = asyncio.create_task(read())
        try:
            while (item := await replies.get()) is not None:
                if isinstance(item, Exception):
                    raise item
                yield item
        finally:
            reader.cancel()  # (a step already queued still runs: the step executor shields it)

    async def _observed(self, request, trace_metadata) -> stage_pb2.ForwardResponse:
        span, start = self.observer.start(request, trace_metadata)
        reply = None
        try:  # a failed step is reported (ERRORS), the service stays up
            reply = await self._forward(request)
            return reply
        finally:
            self.observer.end(span, start, request, reply, None if reply is not None else "failed")

    async def _forward(self, request) -> stage_pb2.ForwardResponse:
        batch = step_from_pb(request.step)
        # the TP followers' copy: the step as received, encoded once (rank 0 adds only the tokens it fills in)
        step_bytes = request.step.SerializeToString() if self.steps.followers is not None else None
        stats, out = await self.steps.forward(request.epoch, batch, step_bytes)
        reply = stage_pb2.ForwardResponse(compute_seconds=stats.compute_seconds, handoff_bytes=stats.handoff_bytes,
                                          handoff_wait_seconds=stats.handoff_wait_seconds)
        if out.sampled or out.prompt_logprobs:
            reply.sampled.CopyFrom(sampled_to_pb(out.sampled, out.prompt_logprobs, out.drafts))
        return reply

    async def LoadLoRAAdapter(self, request, context):
        name, lora = request.adapter.name, self.worker.runner.lora
        try:
            if lora is None:
                raise LoRAError(f"LoRA adapter {name[:64]!r}: this stage runs without --enable-lora")
            check_adapter_name(name)
            path = lora.settings.runtime_path(name, request.adapter.path)
            await asyncio.wrap_future(self.worker.load_lora(name, path))
        except LoRAError as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        return common_pb2.LoadLoRAAdapterResponse()

    async def UnloadLoRAAdapter(self, request, context):
        if not await asyncio.wrap_future(self.worker.unload_lora(request.name)):
            await context.abort(grpc.StatusCode.NOT_FOUND, f"LoRA adapter {request.name[:64]!r} is not loaded")
        return common_pb2.UnloadLoRAAdapterResponse()

    async def CompileGrammar(self, request, context):
        sampler = self.worker.runner.sampler
        structured = sampling_from_pb(request.sampling).structured
        if sampler is None:  # (the service is the stage's TP rank 0, the one that samples on the last stage)
            raise StagemeshError("CompileGrammar goes to the last stage, which samples")
        if structured is None:
            raise InvalidStep("CompileGrammar needs sampling parameters with a structured-output constraint")
        start = time.perf_counter()
        await asyncio.wrap_future(sampler.prepare(structured))  # (InvalidParameter: the client's constraint)
        return stage_pb2.CompileGrammarResponse(seconds=time.perf_counter() - start)

    async def ReadKV(self, request, context):
        async for chunk in kv_connector.read_chunks(self.worker, request):
            yield chunk

    async def PullKV(self, request, context):
        # a failed pull: the decode scheduler's kv_load_failure_policy decides (fail, or recompute the prompt)
        return await kv_connector.pull(self.worker, request, self.kv_peers,
                                       kv_connector.read_bound(context.time_remaining()))

    async def StoreKV(self, request, context):
        await asyncio.wrap_future(self.worker.store_kv(
            request.epoch, list(request.block_ids), list(request.host_slots), list(request.block_hashes),
            list(request.to_disk), list(request.disk_evictions)))
        return stage_pb2.StoreKVResponse()

    async def LoadKV(self, request, context):
        start, w = time.perf_counter(), self.worker
        block_ids, slots, hashes = list(request.block_ids), list(request.host_slots), list(request.block_hashes)
        load_id = w.begin_load(request.epoch, block_ids, slots, hashes)
        reads = await asyncio.to_thread(w.tiers.read, slots, hashes)  # files are read off the step loop
        loaded = await asyncio.wrap_future(w.finish_load(load_id, request.epoch, block_ids, slots, hashes, reads))
        return stage_pb2.LoadKVResponse(loaded=loaded, bytes=sum(loaded) * w.tiers.bytes_per_block,
                                        seconds=time.perf_counter() - start)

    async def PushActivations(self, request, context):
        self._deliver(request)
        return stage_pb2.PushActivationsResponse()

    def _deliver(self, req: stage_pb2.PushActivationsRequest) -> None:
        """Checked activations (or sampled tokens, on the first stage) into the grpc handoff's mailbox."""
        w, handoff = self.worker, self.steps.handoff
        if handoff is None or not handoff.receives_pushes or req.epoch != w.epoch:
            raise StagemeshError(f"activations for epoch {req.epoch} arrived, which is not the stage's")
        if req.HasField("hidden_states") == bool(req.sampled_tokens):
            raise InvalidStep("a PushActivations call carries activations or sampled tokens, one of them")
        if req.sampled_tokens:  # from the last stage, for a step scheduled ahead
            if not w.runner.is_first_stage or w.runner.is_last_stage:
                raise InvalidStep("sampled tokens go to the first stage of a pipeline of several")
            check_tokens(req.sampled_tokens, w.limits)
        else:
            if w.runner.is_first_stage:
                raise InvalidStep("the first stage takes no activations")
            check_activations(req.hidden_states, w.limits)
        handoff.deliver(req)


# what a call raises: a PullKV source its scheduler does not vouch for, or a ReadKV without the blocks' ticket,
# PERMISSION_DENIED; bad input INVALID_ARGUMENT, a state the stage is not in FAILED_PRECONDITION, anything else
# INTERNAL (logged); the stage stays up
ERRORS = ErrorInterceptor(by_type((kv_connector.NotAPeer, grpc.StatusCode.PERMISSION_DENIED),
                                  (kv_connector.KVReadTimeout, grpc.StatusCode.DEADLINE_EXCEEDED),
                                  ((InvalidStep, InvalidParameter), grpc.StatusCode.INVALID_ARGUMENT),
                                  (StagemeshError, grpc.StatusCode.FAILED_PRECONDITION)), log, "stage call")


class ServerThread:
    """The stage's asyncio gRPC server on a thread of its own (the main thread runs the model)."""

    def __init__(self, servicer: StageServicer, host: str, port: int):
        self.servicer, self._host, self._port = servicer, host, port
        self._loop = event_loop.new_event_loop()
        self._started = threading.Event()
        self._error: BaseException | None = None
        self.port = 0
        self._thread = threading.Thread(target=self._loop.run_forever, name="stage-grpc", daemon=True)

    def start(self) -> int:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._serve(), self._loop).result(timeout=60)
        return self.port

    async def _serve(self) -> None:
        # a step's activations travel in PushActivations: far larger than gRPC's 4 MiB default (256 MiB holds
        # 8,192 tokens of a hidden size of 8,192 in fp32)
        options = [("grpc.max_receive_message_length", 256 * 2**20), ("grpc.max_send_message_length", 256 * 2**20)]
        self.server = aio_server(options, ERRORS)
        stage_pb2_grpc.add_StageServicer_to_server(self.servicer, self.server)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.port = add_port(self.server, f"{self._host}:{self._port}")
        if self.port == 0:
            raise StagemeshError(f"cannot listen on {self._host}:{self._port}")
        await self.server.start()
        for name in ("", SERVICE, LIVENESS):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)

    def set_ready(self, ready: bool) -> None:
        """Readiness ("" and the service's name; liveness stays SERVING)."""
        status = health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING

        async def apply() -> None:
            for name in ("", SERVICE):
                await self.health.set(name, status)

        asyncio.run_coroutine_threadsafe(apply(), self._loop).result(timeout=5)

    def stop(self, grace: float = 1.0) -> None:
        if self._thread.is_alive():
            try:
                asyncio.run_coroutine_threadsafe(self.server.stop(grace), self._loop).result(timeout=grace + 5)
            except Exception:  # noqa: BLE001 - stopping anyway
                pass
            self._loop.call_soon_threadsafe(self._loop.stop)
