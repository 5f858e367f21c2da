"""The replica's step loop: continuous batching over the pipeline of stage services.

Up to one micro-batch per stage is in flight, on disjoint sequences (the core
scheduler never schedules a request twice before its result is back), so no
stage idles while requests wait. With async scheduling (the default on GPUs) a
single-stage pipeline keeps a second step in flight on the same sequences,
scheduled ahead of the first one's tokens (the stage fills them in), so its
stage does not idle while the scheduler and the RPCs work between two steps;
a longer pipeline runs a step ahead where a micro-batch would otherwise be
empty (fewer requests than stages: batch 1), its first stage taking the
tokens from the last one. Results are taken in step order.

When a micro-batch's replies arrive, the critical path is short: update the
scheduler, send the next micro-batch, and only then hand the outputs to their
sinks (a request's own stream, or the multiplexed stream of a router's
connection), whose writes overlap the stages' compute. A stage that fails
ends the epoch: every request fails with an error naming the stage, the
replica turns unhealthy, and a new epoch forms once every stage answers again.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import AsyncIterator, Protocol

import grpc

from opentelemetry import trace

from scheduler.config import SchedulerConfig
from scheduler.observe import Observer
from scheduler.output_stream import OutputStream
from scheduler.rendezvous import PipelinePlan, Rendezvous, StageInfo
from scheduler.request import RequestOutput
from scheduler.scheduler import Scheduler, SchedulerOutput
from stagemesh import telemetry
from stagemesh.errors import StagemeshError
from stagemesh.sampling_params import SamplingParams
from stagemesh.service_options import aio_channel
from stagemesh.step import PromptLogprobs, SampledToken
from stagemesh.step_wire import prompt_logprobs_from_pb, sampled_from_pb, step_to_pb
from stagemesh.v1 import stage_pb2, stage_pb2_grpc

log = logging.getLogger("stagemesh.scheduler")


@dataclass(frozen=True)
class DriverConfig:
    max_model_len: int | None  # None: the model's, capped by the KV cache
    model_max_len: int
    eos_token_ids: tuple[int, ...]
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    max_waiting_requests: int = 0
    forward_timeout_s: float = 120.0
    join_timeout_s: float = 300.0
    probe_interval_s: float = 2.0
    async_scheduling: bool | None = None  # None: on when every stage computes on a GPU (see _start_epoch)
    vocab_size: int | None = None  # requests' token ids and the stages' sampled ids are checked against it


@dataclass
class _Sent:
    """A micro-batch's Forward calls, in flight to every stage."""
    start: float  # perf_counter when the step was sent
    span: trace.Span | None
    calls: list[tuple[StageInfo, grpc.aio.UnaryUnaryCall]]
    after: asyncio.Future | None  # done when the step before has been taken in
    taken: asyncio.Future  # done when this step has been taken in (or failed)


class OutputSink(Protocol):
    """Takes a request's outputs without waiting: a request's own stream, or a connection's."""

    def put(self, out: RequestOutput) -> None: ...


class StageFailure(Exception):
    def __init__(self, stage: StageInfo, detail: str):
        super().__init__(f"{stage.name} failed: {detail}")


class Driver:
    def __init__(self, cfg: DriverConfig, rendezvous: Rendezvous, store_host: str, store_port: int):
        self.cfg = cfg
        self.rendezvous = rendezvous
        self.store_host, self.store_port = store_host, store_port
        self.scheduler: Scheduler | None = None
        self.plan: PipelinePlan | None = None
        self.epoch = 0
        self.healthy = False
        self.observer = Observer()
        self.reason = "waiting for stages to register"
        self.sinks: dict[str, OutputSink] = {}  # where each request's outputs go
        self._in_flight: set[asyncio.Task] = set()
        self._channels: dict[str, tuple[grpc.aio.Channel, stage_pb2_grpc.StageStub]] = {}
        self._tasks: set[asyncio.Task] = set()  # background tasks, referenced until done
        self._last_sent: asyncio.Future | None = None
        self._depth = 1  # steps in flight at most
        self.num_steps = 0
        self.step_seconds = 0.0
        self.compute_seconds = 0.0
        self._wake = asyncio.Event()
        self._forming = asyncio.Lock()

    # -- requests -----------------------------------------------------------------
    def add(self, request_id: str, prompt: list[int], sampling: SamplingParams, sink: OutputSink,
            trace_context=None) -> None:
        """Queue a request whose outputs go to `sink` until it finishes. Raises Unavailable, QueueFull or
        StagemeshError (bad input) when it cannot be queued; the caller must release() it when it goes away."""
        if not self.healthy or self.scheduler is None:
            raise Unavailable(f"the replica cannot serve: {self.reason}")
        self.scheduler.add_request(request_id, prompt, sampling)
        self.observer.submitted(request_id, len(prompt), trace_context)
        self.sinks[request_id] = sink
        self._wake.set()

    def release(self, request_id: str) -> None:
        """The caller is done with the request: one still running stops and frees its blocks now."""
        if self.sinks.pop(request_id, None) is not None and self.scheduler is not None:
            self.scheduler.abort([request_id])  # the caller went away
        self.observer.gone(request_id)

    async def submit(self, request_id: str, prompt: list[int], sampling: SamplingParams,
                     trace_context=None) -> AsyncIterator[RequestOutput]:
        """One request's outputs, for a caller that reads them as a stream of its own."""
        stream = OutputStream()
        self.add(request_id, prompt, sampling, stream, trace_context)
        try:
            while True:
                out = await stream.get()
                yield out
                if out.finished:
                    return
        finally:
            self.release(request_id)

    def abort(self, request_ids: list[str]) -> int:
        if self.scheduler is None:
            return 0
        outputs = self.scheduler.abort(request_ids)
        self._dispatch(outputs)
        return len(outputs)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        self.observer.outputs(outputs)
        sinks = self.sinks
        for out in outputs:
            sink = sinks.pop(out.request_id, None) if out.finished else sinks.get(out.request_id)
            if sink is not None:
                sink.put(out)

    # -- the step loop --------------------------------------------------------------
    async def run(self) -> None:
        self.spawn(self._probe_loop())
        while True:
            self._launch()
            if not self._in_flight:
                self._wake.clear()
                await self._wake.wait()
                continue
            done, _ = await asyncio.wait(set(self._in_flight), return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                self._in_flight.discard(task)
                try:
                    task.result()
                except StageFailure as err:
                    self._fail(str(err))
                except Exception as err:  # a bug: the epoch ends (its requests fail) but the loop goes on
                    log.exception("a step failed unexpectedly")
                    self._fail(f"internal error in the scheduler: {type(err).__name__}: {err}")

    def _launch(self) -> None:
        """Fill the pipeline: schedule micro-batches until every stage has one."""
        while self.healthy and len(self._in_flight) < self._depth:
            # split the requests over the micro-batches, so that every stage has work
            share = -(-self.scheduler.num_unfinished // len(self.plan.stages))
            single = len(self.plan.stages) == 1
            output = self.scheduler.schedule(max_seqs=max(share, 1), run_ahead=single)
            if output is None and not single:  # no request left for this micro-batch: run one ahead
                output = self.scheduler.schedule(max_seqs=max(share, 1), run_ahead=True)
            if output is None:
                return
            preempted = list(self.scheduler.recent_preemptions)
            self.scheduler.recent_preemptions.clear()
            self.observer.scheduled(output.request_ids, preempted)
            sent = self._send(output)
            self._in_flight.add(asyncio.create_task(self._step(self.epoch, self.scheduler, output, sent)))

    def _send(self, output: SchedulerOutput) -> _Sent:
        """Start the micro-batch's Forward calls now (not when its task first runs), so that they go out
        ahead of the stream writes queued behind them."""
        start = time.perf_counter()
        batch = output.step_batch
        span, links = self.observer.start_step(batch.step_id, output.request_ids, batch.num_tokens)
        request = stage_pb2.ForwardRequest(epoch=self.epoch, step=step_to_pb(batch), trace_links=links)
        metadata = telemetry.inject(trace.set_span_in_context(span)) if span is not None else None
        calls = [(stage, self._stub(stage).Forward(request, timeout=self.cfg.forward_timeout_s, metadata=metadata))
                 for stage in self.plan.stages]
        sent = _Sent(start, span, calls, self._last_sent, asyncio.get_running_loop().create_future())
        self._last_sent = sent.taken
        return sent

    async def _step(self, epoch: int, scheduler: Scheduler, output: SchedulerOutput, sent: _Sent) -> None:
        try:
            await self._take(epoch, scheduler, output, sent)
        finally:
            if not sent.taken.done():
                sent.taken.set_result(None)

    async def _take(self, epoch: int, scheduler: Scheduler, output: SchedulerOutput, sent: _Sent) -> None:
        span = sent.span
        try:
            replies = await asyncio.gather(*[self._reply(stage, call) for stage, call in sent.calls])
            if sent.after is not None:
                await sent.after  # replies may overtake each other on the wire; results go in step order
        except StageFailure as err:
            if span is not None:
                span.set_status(trace.Status(trace.StatusCode.ERROR, str(err)))
                span.end()
            if epoch != self.epoch:
                return  # a late failure of a step of a broken epoch must not fail the one formed since
            raise
        if epoch != self.epoch or scheduler is not self.scheduler:
            if span is not None:
                span.end()
            return
        self.num_steps += 1
        seconds, compute = time.perf_counter() - sent.start, sum(r.compute_seconds for r in replies)
        self.step_seconds += seconds
        self.compute_seconds += compute
        try:
            sampled = self._sampled(output, replies[-1].sampled)
            scored = self._prompt_logprobs(output, replies[-1].sampled)
        except StagemeshError as err:  # the last stage answered nonsense: it is broken, not the requests
            raise StageFailure(sent.calls[-1][0], str(err)) from None
        outputs = scheduler.update_from_output(output, sampled, scored)
        self._in_flight.discard(asyncio.current_task())
        self._launch()  # the next micro-batch first: the streams are served while the stages compute it
        self._dispatch(outputs)
        self.observer.end_step(span, seconds, compute, scheduler.stats())

    def _sampled(self, output: SchedulerOutput, msg: stage_pb2.SampledTokens) -> list[SampledToken]:
        """The last stage's tokens, checked: one per sampling chunk, in order, each in the vocabulary."""
        c = output.step_batch.chunks
        want = [seq_id for seq_id, sample in zip(c.seq_ids, c.sample) if sample]
        if list(msg.seq_ids) != want:
            raise StagemeshError(f"the stage sampled sequences {list(msg.seq_ids)[:8]}, the step asked for {want[:8]}")
        rows = len(want)
        if (len(msg.token_ids) != rows or len(msg.logprob_rows) != len(msg.logprobs)
                or len(msg.error_rows) != len(msg.errors)
                or any(not 0 <= r < rows for r in (*msg.logprob_rows, *msg.error_rows))):
            raise StagemeshError("the stage's sampled-token columns do not line up")
        vocab = self.cfg.vocab_size
        if vocab is not None and msg.token_ids and (min(msg.token_ids) < 0 or max(msg.token_ids) >= vocab):
            raise StagemeshError(f"the stage sampled a token id outside the vocabulary of {vocab}")
        if len(msg.error_rows) == rows > 1:  # not one request's data: the model itself is failing
            raise StagemeshError(f"every one of the {rows} sequences of the step failed to sample "
                                 f"({msg.errors[0]})")
        return sampled_from_pb(msg)

    def _prompt_logprobs(self, output: SchedulerOutput, msg: stage_pb2.SampledTokens) -> list[PromptLogprobs]:
        """The last stage's prompt logprobs, checked: of sequences in the step, within their chunk."""
        if not msg.prompt_logprobs:
            return []
        c = output.step_batch.chunks
        spans = {seq_id: (start, start + n) for seq_id, start, n in zip(c.seq_ids, c.start_positions, c.num_tokens)}
        vocab = self.cfg.vocab_size or (1 << 31)
        for p in msg.prompt_logprobs:
            lo, hi = spans.get(p.seq_id, (0, -1))
            if not lo < p.start <= hi or p.start + len(p.logprobs) - 1 > hi or \
                    any(not 0 <= e.token_id < vocab for e in p.logprobs):
                raise StagemeshError(f"the stage scored prompt tokens outside sequence {p.seq_id}'s chunk")
        return prompt_logprobs_from_pb(msg)

    @staticmethod
    async def _reply(stage: StageInfo, call) -> stage_pb2.ForwardResponse:
        try:
            return await call
        except grpc.aio.AioRpcError as err:
            raise StageFailure(stage, f"{err.code().name}: {err.details()}") from None
        except asyncio.CancelledError:
            if _cancelling():
                raise
            raise StageFailure(stage, "the call was cancelled") from None

    def _fail(self, reason: str) -> None:
        if not self.healthy:
            return
        log.error("pipeline broken: %s", reason)
        self.healthy, self.reason = False, reason
        self.epoch += 1  # results of the broken epoch are ignored
        if self.scheduler is not None:
            self._dispatch(self.scheduler.fail_all(reason))
        self.scheduler = None

    # -- forming the pipeline ---------------------------------------------------------
    def _stub(self, stage: StageInfo) -> stage_pb2_grpc.StageStub:
        if stage.address not in self._channels:
            channel = aio_channel(stage.address, options=[("grpc.max_receive_message_length", 1 << 30)])
            self._channels[stage.address] = (channel, stage_pb2_grpc.StageStub(channel))
        return self._channels[stage.address][1]

    def _drop_channel(self, address: str) -> None:
        """A new process answers at this address: dial it afresh (the old channel may be backing off).
        The old one closes once every call on it is past its deadline (closing cancels its calls)."""
        entry = self._channels.pop(address, None)
        if entry is not None:
            self.spawn(self._close_later(entry[0], max(self.cfg.forward_timeout_s, self.cfg.join_timeout_s) + 5))

    @staticmethod
    async def _close_later(channel: grpc.aio.Channel, delay_s: float) -> None:
        await asyncio.sleep(delay_s)
        await channel.close()

    def spawn(self, coro) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def register_stage(self, stage: StageInfo) -> tuple[int, bool]:
        """A stage's registration or heartbeat: (stages still missing, whether this instance is new here).
        A new instance at a known index replaces the old one (a restarted stage) unless the old one still
        answers elsewhere; raises StagemeshError (the reason) when the stage does not fit."""
        r = self.rendezvous
        if r.knows(stage):
            return r.missing, False
        r.check(stage)
        old = r.stages.get(stage.stage_index)
        if old is not None and old.address != stage.address and await self._probe(old) is None:
            raise StagemeshError(f"{old.name} is alive and serves index {stage.stage_index}; stop it first, or "
                                 f"give this stage another --stage-index")
        missing = r.register(stage)
        self._drop_channel(stage.address)  # whatever answered there before is gone
        if old is not None:
            self._drop_channel(old.address)
        if r.complete:
            self._fail(f"{stage.name} {'restarted' if old is not None else 'registered'}")
            self.spawn(self.form())
        return missing, True

    async def form(self) -> None:
        async with self._forming:
            if self.healthy or not self.rendezvous.complete:
                return
            plan = self.rendezvous.plan()
            limits = self._limits(plan)
            if limits is None:
                return
            epoch = self.epoch = self.epoch + 1
            try:
                # every stage answers as the instance registered, before any of them waits in the new world
                for failed in await asyncio.gather(*[self._probe(s, wait=True) for s in plan.stages]):
                    if failed is not None:
                        raise StageFailure(*failed)
                await asyncio.gather(*[self._join(plan, i, epoch, limits) for i in range(len(plan.stages))])
            except StageFailure as err:
                self.reason = f"pipeline did not form: {err}"
                log.error("%s", self.reason)
                return
            self._start_epoch(plan, limits[0])

    def _limits(self, plan: PipelinePlan) -> tuple[int, int] | None:
        """(max_model_len, max_num_batched_tokens) of the pipeline, or None (the reason set) if none fits."""
        kv_tokens = plan.num_kv_blocks * self.rendezvous.block_size
        max_len = self.cfg.max_model_len or min(self.cfg.model_max_len, kv_tokens)
        if max_len > kv_tokens:
            self.reason = (f"--max-model-len {max_len} does not fit the KV cache of {kv_tokens:,} tokens; "
                           "lower it or give the stages more KV memory")
            log.error("%s", self.reason)
            return None
        return max_len, self.cfg.max_num_batched_tokens

    async def _join(self, plan: PipelinePlan, index: int, epoch: int, limits: tuple[int, int]) -> None:
        stage = plan.stages[index]
        request = stage_pb2.JoinPipelineRequest(
            epoch=epoch, store_host=self.store_host, store_port=self.store_port, world_size=plan.world_size,
            rank_offset=plan.rank_offsets[index], tp_sizes=plan.tp_sizes, num_kv_blocks=plan.num_kv_blocks,
            next_stage_address=plan.stages[index + 1].address if index + 1 < len(plan.stages) else "",
            first_step_id=0, max_model_len=limits[0], max_num_batched_tokens=limits[1])
        try:
            await self._stub(stage).JoinPipeline(request, timeout=self.cfg.join_timeout_s)
        except grpc.aio.AioRpcError as err:
            raise StageFailure(stage, f"{err.code().name}: {err.details()}") from None
        except asyncio.CancelledError:
            if _cancelling():
                raise
            raise StageFailure(stage, "the call was cancelled") from None

    def _start_epoch(self, plan: PipelinePlan, max_len: int) -> None:
        cfg, block_size = self.cfg, self.rendezvous.block_size
        # CPU stages use every core for the model; overlapping the scheduler, router and client work with
        # it was measured slower there (benchmarks/RESULTS.md, 2026-11-23 async scheduling), so on CPU it
        # is on only when asked for
        async_scheduling = cfg.async_scheduling
        if async_scheduling is None:
            async_scheduling = all(s.device.startswith("cuda") for s in plan.stages)
        kv_tokens = plan.num_kv_blocks * block_size
        self.scheduler = Scheduler(SchedulerConfig(
            num_kv_blocks=plan.num_kv_blocks, max_model_len=max_len, block_size=block_size,
            max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens,
            enable_prefix_caching=cfg.enable_prefix_caching, eos_token_ids=cfg.eos_token_ids,
            max_waiting_requests=cfg.max_waiting_requests, async_scheduling=async_scheduling,
            vocab_size=cfg.vocab_size))
        self.plan, self.max_model_len = plan, max_len
        self._depth = 2 if async_scheduling and len(plan.stages) == 1 else len(plan.stages)
        self._last_sent = None
        for s in plan.stages:
            log.info("stage %d: layers %d:%d, TP=%d, %s, %s handoff, at %s", s.stage_index, s.layer_start,
                     s.layer_end, s.tp_size, s.device, s.handoff, s.address)
        log.info("KV cache size: %s tokens", f"{kv_tokens:,}")
        log.info("Maximum concurrency for %s tokens per request: %.2fx", f"{max_len:,}", kv_tokens / max_len)
        self.healthy, self.reason = True, ""
        log.info("pipeline formed (epoch %d): %d stage(s), world size %d%s", self.epoch, len(plan.stages),
                 plan.world_size, ", async scheduling" if async_scheduling else "")
        self._wake.set()

    async def _probe_loop(self) -> None:
        """Find dead (or replaced) stages while idle; re-form the pipeline once every stage answers again."""
        while True:
            await asyncio.sleep(self.cfg.probe_interval_s)
            try:
                await self._probe_round()
            except Exception:  # noqa: BLE001 - a bug must not end the probing: the next round tries again
                log.exception("probing the stages failed")

    async def _probe_round(self) -> None:
        if not self.rendezvous.complete:
            return
        stages = [self.rendezvous.stages[i] for i in range(self.rendezvous.pp)]
        results = await asyncio.gather(*[self._probe(s) for s in stages])
        failed = next((r for r in results if r is not None), None)
        if failed is not None:
            self._fail(str(StageFailure(*failed)))
        elif not self.healthy and not self._forming.locked():
            await self.form()

    async def _probe(self, stage: StageInfo, wait: bool = False) -> tuple[StageInfo, str] | None:
        """None when the registered instance of `stage` answers; else (stage, what went wrong).
        wait=True gives a (re)starting stage a few seconds to come up."""
        try:
            desc = await self._stub(stage).Describe(stage_pb2.DescribeRequest(), timeout=5.0 if wait else 2.0,
                                                    wait_for_ready=wait)
        except grpc.aio.AioRpcError as err:
            return stage, f"{err.code().name}: {err.details()}"
        except asyncio.CancelledError:
            if _cancelling():
                raise
            return stage, "the call was cancelled"
        if desc.instance_id != stage.instance_id:
            return stage, "another process answers at its address (the stage restarted and has not registered yet)"
        return None


def _cancelling() -> bool:
    """Whether this task is being cancelled (a call's CancelledError without it: the channel closed under it)."""
    task = asyncio.current_task()
    return task is None or task.cancelling() > 0


class Unavailable(StagemeshError):
    """The replica's pipeline is not formed."""
