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
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Protocol

from opentelemetry import trace

from scheduler import handover
from scheduler.epochs import EpochManager
from scheduler.grammar_wait import compile_for
from scheduler.kv_transfer import KVLoadFailed, KVPull, failure_message, run_pull
from scheduler.observe import Observer
from scheduler.output_stream import OutputStream
from scheduler.pipeline import Pipeline, StageFailure, StepResult, check_result
from scheduler.rendezvous import PipelinePlan
from scheduler.request import RequestOutput
from scheduler.scheduler import Scheduler
from scheduler.step_assembly import SchedulerOutput
from scheduler.tiers import KVTiers, LoadJob, StoreJob
from stagemesh.core import telemetry
from stagemesh.core.engine_request import EngineRequest
from stagemesh.core.errors import StagemeshError

log = logging.getLogger("stagemesh.scheduler")


class Unavailable(StagemeshError):
    """The replica's pipeline is not formed."""


class OutputSink(Protocol):
    """Takes a request's outputs without waiting: a request's own stream, or a connection's."""

    def put(self, out: RequestOutput) -> None: ...


@dataclass
class _Sent:
    """A micro-batch in flight through the pipeline."""
    start: float  # perf_counter when the step was sent
    span: trace.Span | None
    result: Awaitable[StepResult]  # the pipeline's answer
    after: asyncio.Future | None  # done when the step before has been taken in
    taken: asyncio.Future  # done when this step has been taken in (or failed)


class StepLoop:
    """Owns the requests' sinks, the steps in flight and the step counters. Runs in the epoch the
    EpochManager owns: reads its epoch, scheduler and plan, and tells it when a step breaks the pipeline."""

    def __init__(self, pipeline: Pipeline, epochs: EpochManager, observer: Observer,
                 spawn: Callable[..., asyncio.Task]):
        self.pipeline, self.epochs, self.observer, self._spawn = pipeline, epochs, observer, spawn
        self.sinks: dict[str, OutputSink] = {}  # where each request's outputs go
        self._in_flight: set[asyncio.Task] = set()
        self._last_sent: asyncio.Future | None = None
        self._depth = 1  # steps in flight at most
        self._lanes = 1  # micro-batches the requests are shared among
        self.num_steps = 0
        self.step_seconds = 0.0
        self.compute_seconds = 0.0
        self._wake = asyncio.Event()  # a request to schedule, with no step in flight
        self._taken = asyncio.Event()  # a step in flight ended
        self.paused = False  # no step is scheduled (a drain hands its requests on: Driver.migrate)
        # a rebalance's hand-on (Driver.migrate_some), done between two steps: (how many, with their KV, its answer)
        self._migration: tuple[int, bool, asyncio.Future] | None = None

    @property
    def in_flight(self) -> frozenset[asyncio.Task]:
        return frozenset(self._in_flight)

    # -- requests -----------------------------------------------------------------
    def add(self, request: EngineRequest, sink: OutputSink) -> None:
        """Queue a request whose outputs go to `sink` until it finishes. Raises Unavailable, QueueFull or
        StagemeshError (bad input) when it cannot be queued; the caller must release() it when it goes away."""
        scheduler = self.epochs.scheduler
        if not self.epochs.healthy or scheduler is None:
            raise Unavailable(f"the replica cannot serve: {self.epochs.reason}")
        try:
            usable = scheduler.add_request(request)
        except KVLoadFailed as err:
            self.observer.kv_load_refused("not_fit", "fail")
            log.warning("%s", err)
            self._spawn(self.pipeline.release_kv(request.kv_source))  # (a --kv-peer's: the service checked) unused
            raise
        if not usable:
            self.observer.kv_load_refused("not_fit", "recompute")
            kv_source = request.kv_source
            assert kv_source is not None  # (only a request's kv_source can be unusable)
            self._spawn(self.pipeline.release_kv(kv_source))
            log.warning("request %s: the KV held on %s does not fit this replica (block size %d, %d tokens held for "
                        "a prompt of %d): computing the prompt here", request.request_id, kv_source.scheduler_address,
                        kv_source.block_size, kv_source.num_tokens, len(request.prompt_token_ids))
        trace_context = telemetry.extract([("traceparent", request.traceparent), ("tracestate", request.tracestate)]
                                          if request.traceparent else None)
        self.observer.submitted(request.request_id, len(request.prompt_token_ids), trace_context,
                                len(request.generated_token_ids))
        self.sinks[request.request_id] = sink
        if request.sampling.structured is not None:  # scheduled once its last stage compiled it (grammar_wait)
            scheduler.wait_for_grammar(request.request_id, True)
            self._spawn(self._admit_when_compiled(request))
        self._wake.set()

    async def _admit_when_compiled(self, request: EngineRequest) -> None:
        assert request.sampling.structured is not None  # (a structured request's)
        error = await compile_for(self.pipeline, request.request_id, request.sampling.structured,
                                  self.epochs.cfg.grammar_compile_timeout_s)
        scheduler = self.epochs.scheduler  # (the one that has it now: a new epoch requeues it into another)
        if scheduler is None:
            return
        if error is None:
            scheduler.wait_for_grammar(request.request_id, False)
            self._wake.set()
        else:
            self.dispatch(scheduler.fail([request.request_id], error, own_fault=True))

    def release(self, request_id: str) -> None:
        """The caller is done with the request: one still running stops and frees its blocks now."""
        if self.sinks.pop(request_id, None) is not None and self.epochs.scheduler is not None:
            self.epochs.scheduler.abort([request_id])  # the caller went away
            self._release_held(self.epochs.scheduler)  # a prefill replica's KV it had not loaded yet: freed now
        self.observer.gone(request_id)

    async def submit(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """One request's outputs, for a caller that reads them as a stream of its own."""
        stream = OutputStream()
        self.add(request, stream)
        try:
            while True:
                out = await stream.get()
                yield out
                if out.finished:
                    return
        finally:
            self.release(request.request_id)

    def abort(self, request_ids: list[str]) -> int:
        if self.epochs.scheduler is None:
            return 0
        outputs = self.epochs.scheduler.abort(request_ids)
        self._release_held(self.epochs.scheduler)
        self.dispatch(outputs)
        return len(outputs)

    def dispatch(self, outputs: list[RequestOutput]) -> None:
        """Outputs to their requests' sinks (a finished request's sink is let go)."""
        self.observer.outputs(outputs)
        sinks = self.sinks
        for out in outputs:
            sink = sinks.pop(out.request_id, None) if out.finished else sinks.get(out.request_id)
            if sink is not None:
                sink.put(out)

    def migrate_some(self, max_requests: int, with_kv: bool) -> asyncio.Future:
        """Up to max_requests running requests end "migrated" at the next point between two steps (when a step's
        results are in, before the next is scheduled: scheduler.handover.migrate_some); the future's result is
        their outputs, dispatched already."""
        if self._migration is not None and not self._migration[2].done():  # (one at a time: the earlier one is
            self._migration[2].set_result([])  # answered with nothing moved, unless its caller gave up already)
        done = asyncio.get_running_loop().create_future()
        self._migration = (max_requests, with_kv, done)
        self._wake.set()
        return done

    def _migrate(self, scheduler: Scheduler) -> None:
        if self._migration is None:
            return
        (max_requests, with_kv, done), self._migration = self._migration, None
        if done.done():  # (its caller gave up waiting: nothing moves)
            return
        outputs = handover.migrate_some(scheduler, max_requests, with_kv)
        self.stamp_held(outputs)
        self.dispatch(outputs)
        done.set_result(outputs)

    def start_epoch(self, plan: PipelinePlan, async_scheduling: bool) -> None:
        """A new epoch formed: size the steps in flight for it and go."""
        # stage processes compute different micro-batches at once; in one process one step runs at a time
        self._lanes = len(plan.stages) if self.pipeline.overlaps_stages else 1
        self._depth = 2 if async_scheduling and self._lanes == 1 else self._lanes
        self._last_sent = None
        self._wake.set()

    # -- the step loop --------------------------------------------------------------
    async def run(self) -> None:
        while True:
            self._launch()
            # a step's end wakes the loop through its done callback (_taken), a new request through _wake; with
            # steps in flight only their end fills the pipeline again (no asyncio.wait: its waiter and callbacks a step)
            wake = self._taken if self._in_flight else self._wake
            wake.clear()
            await wake.wait()

    def _taken_in(self, task: asyncio.Task) -> None:
        """A step's task ended: its failure ends the epoch, and the loop fills the pipeline again."""
        self._in_flight.discard(task)
        self._taken.set()
        if task.cancelled():
            return
        err = task.exception()
        if isinstance(err, StageFailure):
            self.epochs.fail(str(err))
        elif err is not None:  # a bug: the epoch ends (its requests fail) but the loop goes on
            log.error("a step failed unexpectedly", exc_info=err)
            self.epochs.fail(f"internal error in the scheduler: {type(err).__name__}: {err}")

    def _launch(self) -> None:
        """Fill the pipeline, and start the KV tiers' copies that wait."""
        self._fill()
        scheduler = self.epochs.scheduler
        tiers = scheduler.kv.tiers if scheduler is not None and self.epochs.healthy else None
        if scheduler is not None and tiers is not None:
            for load in tiers.take_loads():
                self._spawn(self._load(self.epochs.epoch, scheduler, load))
            store = tiers.take_store()
            if store is not None:
                self._spawn(self._store(self.epochs.epoch, scheduler, tiers, store))

    def _fill(self) -> None:
        """Schedule micro-batches until every stage has one."""
        epochs = self.epochs
        scheduler = epochs.scheduler  # (the same through the loop: nothing in it awaits)
        if scheduler is None:  # (none without an epoch: not healthy either)
            return
        self._release_held(scheduler)
        self._migrate(scheduler)
        while epochs.healthy and not self.paused and len(self._in_flight) < self._depth:
            epoch = epochs.epoch
            # split the requests over the micro-batches, so that every stage has work
            share = max(-(-scheduler.num_unfinished // self._lanes), 1)
            single = self._lanes == 1
            output = scheduler.schedule(max_seqs=share, run_ahead=single)
            if output is None and not single:  # no request left for this micro-batch: run one ahead
                output = scheduler.schedule(max_seqs=share, run_ahead=True)
            for pull in scheduler.transfers.take_pulls():  # prompts whose KV a prefill replica holds
                self._spawn(self._pull(epoch, scheduler, pull))
            if output is None:
                return
            preempted = list(scheduler.recent_preemptions)
            scheduler.recent_preemptions.clear()
            self.observer.scheduled(output.request_ids, preempted)
            batch = output.step_batch
            span, links = self.observer.start_step(batch.step_id, output.request_ids, batch.num_tokens)
            start = time.perf_counter()
            try:
                result = self.pipeline.forward(epoch, batch, span, links)
            except StageFailure as err:  # it failed at once: the step's task ends the epoch
                result = _failed(err)
            sent = _Sent(start, span, result, self._last_sent, asyncio.get_running_loop().create_future())
            self._last_sent = sent.taken
            task = asyncio.create_task(self._step(epoch, scheduler, output, sent))
            task.add_done_callback(self._taken_in)
            self._in_flight.add(task)

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
            if epoch != self.epochs.epoch:
                return  # a late failure of a step of a broken epoch must not fail the one formed since
            raise
        if epoch != self.epochs.epoch or scheduler is not self.epochs.scheduler:
            if span is not None:
                span.end()
            return
        self.num_steps += 1
        seconds = time.perf_counter() - sent.start
        self.step_seconds += seconds
        self.compute_seconds += result.compute_seconds
        plan = self.epochs.plan
        assert plan is not None  # (set when the step's epoch formed; never unset)
        stages = plan.stages
        try:
            check_result(output.step_batch, result, scheduler.config.vocab_size)
        except StagemeshError as err:  # the last stage answered nonsense: it is broken, not the requests
            raise StageFailure(stages[-1], str(err)) from None
        outputs = scheduler.update_from_output(output, result.sampled, result.prompt_logprobs, result.drafts)
        self.stamp_held(outputs, epoch)
        self._in_flight.discard(asyncio.current_task())
        if self._migration is not None:  # (a rebalance: the step's tokens go out before the hand-on)
            self.dispatch(outputs)
            outputs = []
            self._migrate(scheduler)
        self._launch()  # the next micro-batch first: the streams are served while the stages compute it
        self.dispatch(outputs)
        self.observer.end_step(span, seconds, result.compute_seconds, scheduler.stats())

    def stamp_held(self, outputs: list[RequestOutput], epoch: int | None = None) -> None:
        """Where the KV of outputs that hold some waits for another replica: the epoch and its stages."""
        plan = self.epochs.plan
        if plan is None:
            return
        stages = tuple((s.address, s.layer_start, s.layer_end) for s in plan.stages)
        for out in outputs:
            if out.held_kv is not None:
                out.held_kv = replace(out.held_kv, epoch=self.epochs.epoch if epoch is None else epoch,
                                      stages=stages)

    async def _pull(self, epoch: int, scheduler: Scheduler, pull: KVPull) -> None:
        """Fetch a prompt's KV from the prefill replica holding it and let that replica free it; if that fails
        (or passes --kv-load-timeout), the kv_load_failure_policy decides: the request fails, or computes its
        prompt."""
        cfg = scheduler.config
        result = await run_pull(self.pipeline, epoch, pull, cfg.kv_load_failure_policy, cfg.kv_load_timeout_s,
                                scheduler.transfers.released, self._spawn)
        request = scheduler.transfers.fetching.get(pull.request_id)
        waited = time.monotonic() - request.arrival_time if request is not None else None
        self.observer.kv_loaded(result, cfg.kv_load_failure_policy, waited)
        if scheduler is self.epochs.scheduler:
            error = "" if result.ok else failure_message(pull.request_id, pull.source.scheduler_address,
                                                         result.reason, result.detail)
            self.dispatch(scheduler.kv_pulled(pull.request_id, result.ok, error))
            self._wake.set()

    def _release_held(self, scheduler: Scheduler) -> None:
        """The KV prefill replicas hold for requests that ended before loading it: released now."""
        for source in scheduler.transfers.take_releases():
            self._spawn(self.pipeline.release_kv(source))


    async def _store(self, epoch: int, scheduler: Scheduler, tiers: KVTiers, job: StoreJob) -> None:
        """Copy blocks that entered the prefix cache into the KV tiers (scheduler.tiers)."""
        start, ok = time.perf_counter(), True
        try:
            await self.pipeline.store_kv(epoch, job.block_ids, job.host_slots, job.hashes, job.to_disk,
                                         job.disk_evictions)
        except Exception as err:  # noqa: BLE001 - the blocks are then in no tier; a dead stage is the probe's
            log.warning("storing %d KV block(s) in the KV tiers failed: %s", len(job.block_ids), err)
            ok = False
        if scheduler is self.epochs.scheduler and tiers is scheduler.kv.tiers:
            tiers.stored(job, ok)
            self.observer.kv_tier_stored(job, ok, time.perf_counter() - start)
            self._wake.set()

    async def _load(self, epoch: int, scheduler: Scheduler, job: LoadJob) -> None:
        """Fill a waiting request's blocks from the KV tiers; it runs from the first block that did not load."""
        start = time.perf_counter()
        try:
            flags = await self.pipeline.load_kv(epoch, job.block_ids, job.host_slots, job.hashes)
        except Exception as err:  # noqa: BLE001 - the request computes those blocks
            log.warning("request %s: loading %d KV block(s) from the KV tiers failed (%s): computing them",
                        job.request_id, len(job.block_ids), err)
            flags = [False] * len(job.block_ids)
        if scheduler is self.epochs.scheduler:
            scheduler.kv_tier_loaded(job, flags)
            self.observer.kv_tier_loaded(job, flags, time.perf_counter() - start)
            self._wake.set()


async def _failed(err: StageFailure) -> StepResult:
    raise err
