"""The replica's step loop: continuous batching over a pipeline of stages (scheduler.pipeline).

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
connection), whose writes overlap the stages' compute.

A stage that fails ends the epoch and the replica turns unhealthy (new
requests go to other replicas), but its requests are kept, as if preempted:
generated tokens kept, KV gone with the epoch (Scheduler.requeue_all). When a
new epoch forms (the stage restarted, or a standby stage took its place)
within --stage-recovery-timeout, the new epoch's scheduler takes them over and
recomputes prompt + generated tokens: their streams stall, then go on, with the
tokens they would have had (a seeded request draws by (seed, position)). A
request that was in flight at more than --max-request-retries failures, and
every request still kept when the window ends, fails with an error naming the
stage (the router continues it on another replica).
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field, replace
from typing import AsyncIterator, Protocol

from opentelemetry import trace

from scheduler.config import SchedulerConfig
from scheduler.kv_events import KVEventHub
from scheduler.kv_transfer import run_pull
from scheduler.observe import Observer
from scheduler.output_stream import OutputStream
from scheduler.pipeline import Pipeline, StageFailure, StepResult, check_result
from scheduler.rendezvous import PipelinePlan, StageInfo
from scheduler.request import RequestOutput
from scheduler.scheduler import Scheduler, SchedulerOutput
from stagemesh.core.errors import StagemeshError
from stagemesh.core.speculative import ASYNC_WITH_SPECULATION
from stagemesh.core.sampling_params import SamplingParams

log = logging.getLogger("stagemesh.scheduler")


@dataclass(frozen=True)
class DriverConfig:
    # the scheduler's settings; the KV cache size and the context length are decided when the pipeline forms
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    model_max_len: int = 1 << 31  # the model's positions: max_model_len when the scheduler's is None
    probe_interval_s: float = 2.0
    stage_recovery_timeout_s: float = 30.0  # how long requests are kept for a pipeline to re-form (0: fail at once)
    max_request_retries: int = 3  # pipelines that may break under a request before it fails
    async_scheduling: bool | None = None  # None: on when every stage computes on a GPU (see _start_epoch)

    def __post_init__(self) -> None:
        if self.async_scheduling and self.scheduler.speculative is not None:
            raise StagemeshError(ASYNC_WITH_SPECULATION)


@dataclass
class _Sent:
    """A micro-batch in flight through the pipeline."""
    start: float  # perf_counter when the step was sent
    span: trace.Span | None
    result: asyncio.Future | None  # the pipeline's answer
    after: asyncio.Future | None  # done when the step before has been taken in
    taken: asyncio.Future  # done when this step has been taken in (or failed)


class OutputSink(Protocol):
    """Takes a request's outputs without waiting: a request's own stream, or a connection's."""

    def put(self, out: RequestOutput) -> None: ...


class Driver:
    def __init__(self, cfg: DriverConfig, pipeline: Pipeline):
        self.cfg = cfg
        self.pipeline = pipeline
        self.scheduler: Scheduler | None = None
        self.plan: PipelinePlan | None = None
        self.max_model_len = 0
        self.epoch = 0
        self.healthy = False
        self.observer = Observer()
        self.reason = "waiting for stages to register"
        self.sinks: dict[str, OutputSink] = {}  # where each request's outputs go
        self._in_flight: set[asyncio.Task] = set()
        self._tasks: set[asyncio.Task] = set()  # background tasks, referenced until done
        self._last_sent: asyncio.Future | None = None
        self._depth = 1  # steps in flight at most
        self._lanes = 1  # micro-batches the requests are shared among
        self.num_steps = 0
        self.step_seconds = 0.0
        self.compute_seconds = 0.0
        self._wake = asyncio.Event()
        self._forming = asyncio.Lock()
        self._recovery: asyncio.Task | None = None  # fails the kept requests when the window ends
        self.kv_events = KVEventHub(lambda: self.scheduler.kv if self.scheduler is not None else None)

    # -- requests -----------------------------------------------------------------
    def add(self, request_id: str, prompt: list[int], sampling: SamplingParams, sink: OutputSink,
            trace_context=None, generated: list[int] = (), priority: int = 0, prefill_only: bool = False,
            kv_source=None) -> None:
        """Queue a request whose outputs go to `sink` until it finishes (`generated`: the tokens a request
        continued from another replica produced there). Raises Unavailable, QueueFull or StagemeshError (bad
        input) when it cannot be queued; the caller must release() it when it goes away."""
        if not self.healthy or self.scheduler is None:
            raise Unavailable(f"the replica cannot serve: {self.reason}")
        if not self.scheduler.add_request(request_id, prompt, sampling, generated, priority, prefill_only, kv_source):
            log.warning("request %s: the KV held on %s does not fit this replica (block size %d, %d tokens held for "
                        "a prompt of %d): computing the prompt here", request_id, kv_source.scheduler_address,
                        kv_source.block_size, kv_source.num_tokens, len(prompt))
        self.observer.submitted(request_id, len(prompt), trace_context, len(generated))
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
            share = max(-(-self.scheduler.num_unfinished // self._lanes), 1)
            single = self._lanes == 1
            output = self.scheduler.schedule(max_seqs=share, run_ahead=single)
            if output is None and not single:  # no request left for this micro-batch: run one ahead
                output = self.scheduler.schedule(max_seqs=share, run_ahead=True)
            for pull in self.scheduler.transfers.take_pulls():  # prompts whose KV a prefill replica holds
                self.spawn(self._pull(self.epoch, self.scheduler, pull))
            if output is None:
                return
            preempted = list(self.scheduler.recent_preemptions)
            self.scheduler.recent_preemptions.clear()
            self.observer.scheduled(output.request_ids, preempted)
            batch = output.step_batch
            span, links = self.observer.start_step(batch.step_id, output.request_ids, batch.num_tokens)
            sent = _Sent(time.perf_counter(), span, None, self._last_sent, asyncio.get_running_loop().create_future())
            self._last_sent = sent.taken
            try:
                sent.result = self.pipeline.forward(self.epoch, batch, span, links)
            except StageFailure as err:  # it failed at once: the step's task ends the epoch
                sent.result = _failed(err)
            self._in_flight.add(asyncio.create_task(self._step(self.epoch, self.scheduler, output, sent)))

    async def _step(self, epoch: int, scheduler: Scheduler, output: SchedulerOutput, sent: _Sent) -> None:
        try:
            await self._take(epoch, scheduler, output, sent)
        finally:
            if not sent.taken.done():
                sent.taken.set_result(None)

    async def _take(self, epoch: int, scheduler: Scheduler, output: SchedulerOutput, sent: _Sent) -> None:
        span = sent.span
        try:
            result: StepResult = await sent.result
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
        seconds = time.perf_counter() - sent.start
        self.step_seconds += seconds
        self.compute_seconds += result.compute_seconds
        try:
            check_result(output.step_batch, result, scheduler.config.vocab_size)
        except StagemeshError as err:  # the last stage answered nonsense: it is broken, not the requests
            raise StageFailure(self.plan.stages[-1], str(err)) from None
        outputs = scheduler.update_from_output(output, result.sampled, result.prompt_logprobs, result.drafts)
        for out in outputs:
            if out.held_kv is not None:  # where its KV waits for a decode replica
                out.held_kv = replace(out.held_kv, epoch=epoch, stages=tuple(
                    (s.address, s.layer_start, s.layer_end) for s in self.plan.stages))
        self._in_flight.discard(asyncio.current_task())
        self._launch()  # the next micro-batch first: the streams are served while the stages compute it
        self._dispatch(outputs)
        self.observer.end_step(span, seconds, result.compute_seconds, scheduler.stats())

    async def _pull(self, epoch: int, scheduler: Scheduler, pull) -> None:
        """Fetch a prompt's KV from the prefill replica holding it (the request computes its prompt if that
        fails), then let that replica free it."""
        ok = await run_pull(self.pipeline, epoch, pull, self.observer)
        if scheduler is self.scheduler:
            scheduler.kv_pulled(pull.request_id, ok)
            self._wake.set()
        await self.pipeline.release_kv(pull.source)

    def _fail(self, reason: str) -> None:
        if not self.healthy:
            return
        log.error("pipeline broken: %s", reason)
        self.healthy, self.reason = False, reason
        self.epoch += 1  # results of the broken epoch are ignored
        scheduler, window = self.scheduler, self.cfg.stage_recovery_timeout_s
        if scheduler is None or window <= 0 or not scheduler.num_unfinished:
            self._give_up(scheduler, reason)
            return
        # kept for the next epoch: it is the replica's scheduler until then (aborts and stats go to it)
        requests = scheduler.requeue_all()
        limit = self.cfg.max_request_retries
        tired = [r.request_id for r in requests if r.num_recoveries > limit]
        if tired:
            self._dispatch(scheduler.fail(tired, f"{reason} (the pipeline broke under this request {limit + 1} "
                                                 f"times; --max-request-retries {limit})"))
        kept = [r.request_id for r in requests if r.num_recoveries <= limit]
        self.observer.stalled(kept, reason)
        log.warning("keeping %d request(s) for up to %gs (--stage-recovery-timeout) until the pipeline re-forms",
                    len(kept), window)
        self._recovery = self.spawn(self._give_up_after(window, scheduler, reason))

    async def _give_up_after(self, seconds: float, scheduler: Scheduler, reason: str) -> None:
        await asyncio.sleep(seconds)
        if self.scheduler is scheduler and not self.healthy:
            log.error("the pipeline did not re-form within %gs: %d kept request(s) fail", seconds,
                      scheduler.num_unfinished)
            self._give_up(scheduler, reason)

    def _give_up(self, scheduler: Scheduler | None, reason: str) -> None:
        if scheduler is not None:
            self._dispatch(scheduler.fail_all(reason))
        self.scheduler = None

    async def close(self) -> None:
        """Cancel the background tasks and the steps in flight (run() is its caller's to cancel)."""
        tasks = [*self._tasks, *self._in_flight]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def spawn(self, coro) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # -- forming the pipeline ---------------------------------------------------------
    async def register_stage(self, stage: StageInfo) -> tuple[int, bool]:
        """A stage's registration or heartbeat (a pipeline of stage services): (stages still missing, whether
        this instance is new here). Raises StagemeshError (the reason) when the stage does not fit."""
        missing, new, change = await self.pipeline.register(stage)
        if change is not None:
            self._fail(change)
            self.spawn(self.form())
        return missing, new

    async def form(self) -> None:
        """Start a new epoch once every stage is there and answers."""
        async with self._forming:
            if self.healthy:
                return
            plan = self.pipeline.layout()
            if plan is None:
                return
            max_len = self._max_model_len(plan)
            if max_len is None:
                return
            epoch = self.epoch = self.epoch + 1
            try:
                await self.pipeline.join(epoch, plan, max_len, self.cfg.scheduler.max_num_batched_tokens)
            except StageFailure as err:
                self.reason = f"pipeline did not form: {err}"
                log.error("%s", self.reason)
                return
            self._start_epoch(plan, max_len)

    def _max_model_len(self, plan: PipelinePlan) -> int | None:
        """The pipeline's context length, or None (the reason set) if none fits."""
        kv_tokens = plan.num_kv_blocks * self.pipeline.block_size
        max_len = self.cfg.scheduler.max_model_len or min(self.cfg.model_max_len, kv_tokens)
        if max_len > kv_tokens:
            self.reason = (f"--max-model-len {max_len} does not fit the KV cache of {kv_tokens:,} tokens; "
                           "lower it or give the stages more KV memory")
            log.error("%s", self.reason)
            return None
        return max_len

    def _start_epoch(self, plan: PipelinePlan, max_len: int) -> None:
        # CPU stages use every core for the model; overlapping the scheduler, router and client work with
        # it was measured slower there (benchmarks/RESULTS.md, 2026-11-23 async scheduling), so on CPU it
        # is on only when asked for
        async_scheduling = self.cfg.async_scheduling
        if async_scheduling is None:  # (speculation refuses it: scheduler.config)
            async_scheduling = all(s.device.startswith("cuda") for s in plan.stages) and \
                self.cfg.scheduler.speculative is None
        block_size = self.pipeline.block_size
        kept, self.scheduler = self.scheduler, Scheduler(replace(
            self.cfg.scheduler, num_kv_blocks=plan.num_kv_blocks, max_model_len=max_len, block_size=block_size,
            async_scheduling=async_scheduling))
        if self._recovery is not None:
            self._recovery.cancel()
            self._recovery = None
        if kept is not None:  # the requests kept through the broken epoch go on in this one
            self._dispatch(self.scheduler.take_over(kept))
            log.info("resuming %d request(s) kept from the broken epoch", self.scheduler.num_unfinished)
        self.plan, self.max_model_len = plan, max_len
        # stage processes compute different micro-batches at once; in one process one step runs at a time
        self._lanes = len(plan.stages) if self.pipeline.overlaps_stages else 1
        self._depth = 2 if async_scheduling and self._lanes == 1 else self._lanes
        self._last_sent = None
        for s in plan.stages:
            log.info("stage %d: layers %d:%d, TP=%d, %s, %s handoff, at %s", s.stage_index, s.layer_start,
                     s.layer_end, s.tp_size, s.device, s.handoff, s.address)
        kv_tokens = plan.num_kv_blocks * block_size
        log.info("KV cache size: %s tokens", f"{kv_tokens:,}")
        log.info("Maximum concurrency for %s tokens per request: %.2fx", f"{max_len:,}", kv_tokens / max_len)
        self.healthy, self.reason = True, ""
        spec = self.cfg.scheduler.speculative
        log.info("pipeline formed (epoch %d): %d stage(s), world size %d%s%s", self.epoch, len(plan.stages),
                 plan.world_size, ", async scheduling" if async_scheduling else "",
                 f", speculative decoding: {spec.describe()}" if spec is not None else "")
        self._wake.set()

    async def _probe_loop(self) -> None:
        """Find dead (or replaced) stages while idle; re-form the pipeline once every stage answers again."""
        while True:
            await asyncio.sleep(self.cfg.probe_interval_s)
            if self.scheduler is not None:  # prefilled KV no decode replica came for (an idle replica too)
                for request_id in self.scheduler.transfers.expire(self.scheduler.kv, time.monotonic()):
                    log.warning("request %s: no decode replica fetched its KV within --kv-hold-timeout: freed",
                                request_id)
            try:
                failed = await self.pipeline.probe()
                if failed is not None:
                    self._fail(str(failed))
                elif not self.healthy and not self._forming.locked():
                    await self.form()
            except Exception:  # noqa: BLE001 - a bug must not end the probing: the next round tries again
                log.exception("probing the stages failed")


async def _failed(err: StageFailure) -> StepResult:
    raise err


class Unavailable(StagemeshError):
    """The replica's pipeline is not formed."""
