"""A replica's driver: the step loop (scheduler.step_loop) in the epochs of its pipeline (scheduler.epochs).

The driver wires the two together, owns their background tasks, and shows its service what the replica
looks like through a read-only snapshot (DriverStatus).
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import AsyncIterator

from scheduler import handover
from scheduler.config import DriverConfig
from scheduler.epochs import EpochManager
from scheduler.kv_events import KVEventHub
from scheduler.observe import Observer
from scheduler.pipeline import Pipeline
from scheduler.rendezvous import StageInfo
from scheduler.request import RequestOutput
from scheduler.scheduler import Scheduler
from scheduler.stats import SchedulerStats
from scheduler.step_loop import OutputSink, StepLoop, Unavailable
from stagemesh.core.engine_request import EngineRequest

__all__ = ["Driver", "DriverConfig", "DriverStatus", "OutputSink", "Unavailable"]

log = logging.getLogger("stagemesh.scheduler")


@dataclass(frozen=True)
class DriverStatus:
    """The replica at one moment, as its service reports it."""
    healthy: bool
    reason: str  # why the replica cannot serve ("" while it can)
    epoch: int
    block_size: int
    num_stages: int  # the stages the pipeline is made of
    stages: tuple[StageInfo, ...]  # the last epoch's stages (empty: none formed yet)
    tp_sizes: tuple[int, ...]  # and their TP sizes
    max_model_len: int  # the last epoch's context length (0: none formed yet)
    kv_cache_tokens: int  # the last epoch's KV cache (0: none formed yet)
    num_steps: int
    step_seconds: float
    compute_seconds: float
    scheduler: SchedulerStats | None  # None: no scheduler (no epoch, or its requests given up)
    eos_token_ids: tuple[int, ...]
    scheduling_policy: str
    max_waiting_requests: int


class Driver:
    def __init__(self, cfg: DriverConfig, pipeline: Pipeline):
        self.cfg = cfg
        self.pipeline = pipeline
        spec = cfg.scheduler.speculative
        self.observer = Observer(num_speculative_tokens=spec.num_speculative_tokens if spec is not None else 0)
        self._tasks: set[asyncio.Task] = set()  # background tasks, referenced until done
        self.epochs = EpochManager(cfg, pipeline, self.observer, self.spawn,
                                   dispatch=lambda outputs: self.steps.dispatch(outputs),
                                   started=lambda plan, async_scheduling: self.steps.start_epoch(plan,
                                                                                                  async_scheduling))
        self.steps = StepLoop(pipeline, self.epochs, self.observer, self.spawn)
        self.kv_events = KVEventHub(lambda: self.epochs.scheduler.kv if self.epochs.scheduler is not None else None)

    # -- requests (scheduler.step_loop) ----------------------------------------------
    def add(self, request: EngineRequest, sink: OutputSink) -> None:
        """See StepLoop.add."""
        self.steps.add(request, sink)

    def release(self, request_id: str) -> None:
        self.steps.release(request_id)

    def submit(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        return self.steps.submit(request)

    def abort(self, request_ids: list[str]) -> int:
        return self.steps.abort(request_ids)

    async def migrate(self, reason: str, timeout_s: float) -> tuple[int, int]:
        """The drain's end: no step more; once the steps in flight are back (at most timeout_s), every request
        ends "migrated" for its router to go on with it elsewhere, with its KV under --migration-policy kv
        (scheduler.handover.migrate_all); any still in flight then fails with `reason` (UNAVAILABLE: continued by
        recompute). Returns (moved with their KV, moved without)."""
        self.steps.paused = True
        if self.steps.in_flight:
            await asyncio.wait(self.steps.in_flight, timeout=timeout_s)
        scheduler = self.epochs.scheduler  # (after the wait: the one of the epoch now)
        if scheduler is None:
            return 0, 0
        outputs = handover.migrate_all(scheduler, self.cfg.scheduler.migration_policy == "kv")
        self.steps.stamp_held(outputs)
        with_kv = sum(1 for out in outputs if out.held_kv is not None)
        outputs += scheduler.fail_all(reason)  # (in flight still, pulling their prompt's KV, loading from a tier)
        self.steps.dispatch(outputs)
        return with_kv, len(outputs) - with_kv

    async def migrate_some(self, max_requests: int, timeout_s: float) -> tuple[int, int]:
        """A router rebalances: up to max_requests running requests end "migrated" between two steps, for it to go
        on with them elsewhere (scheduler.handover.migrate_some), while the replica serves the rest; at most
        timeout_s for the steps in flight to come back. Returns (moved with their KV, moved without)."""
        if self.epochs.scheduler is None or self.steps.paused:
            return 0, 0
        done = self.steps.migrate_some(max_requests, self.cfg.scheduler.migration_policy == "kv")
        try:
            outputs = await asyncio.wait_for(asyncio.shield(done), timeout_s)
        except asyncio.TimeoutError:
            log.warning("rebalance: no point between two steps came in %gs: nothing handed on", timeout_s)
            done.cancel()
            return 0, 0
        with_kv = sum(1 for out in outputs if out.held_kv is not None)
        return with_kv, len(outputs) - with_kv

    def holds_kv(self) -> int:
        """Requests whose KV is held here for another replica (migrated, prefilled)."""
        scheduler = self.epochs.scheduler
        return len(scheduler.transfers.held) if scheduler is not None else 0

    def release_kv(self, request_id: str) -> bool:
        """Free the KV a prefilled request holds here (False: none held)."""
        scheduler = self.epochs.scheduler
        released = scheduler is not None and scheduler.release_kv(request_id)
        if released:
            log.info("request %s: its KV released (by a decode replica, or the router)", request_id)
        return released

    def subscribe_kv_events(self) -> asyncio.Queue:
        """The replica's KV cache events (scheduler.kv_events.KVEventHub.subscribe)."""
        return self.kv_events.subscribe()

    def unsubscribe_kv_events(self, queue: asyncio.Queue) -> None:
        self.kv_events.unsubscribe(queue)

    # -- the pipeline (scheduler.epochs) -----------------------------------------------
    async def register_stage(self, stage: StageInfo) -> tuple[int, bool]:
        """See EpochManager.register_stage."""
        return await self.epochs.register_stage(stage)

    async def form(self) -> None:
        await self.epochs.form()

    async def refused(self) -> str:
        """Returns, with the reason, once the replica's configuration turned out unable to serve at all
        (EpochManager.refusal); the scheduler then exits."""
        await self.epochs.refused.wait()
        return self.epochs.refusal

    @property
    def healthy(self) -> bool:
        return self.epochs.healthy

    @property
    def reason(self) -> str:
        return self.epochs.reason

    @property
    def scheduler(self) -> Scheduler | None:
        """The replica's scheduler (None: no epoch); for in-process callers that read its stats."""
        return self.epochs.scheduler

    def status(self) -> DriverStatus:
        e, s, c = self.epochs, self.steps, self.cfg.scheduler
        plan = e.plan
        return DriverStatus(
            healthy=e.healthy, reason=e.reason, epoch=e.epoch, block_size=self.pipeline.block_size,
            num_stages=self.pipeline.num_stages, stages=tuple(plan.stages) if plan is not None else (),
            tp_sizes=tuple(plan.tp_sizes) if plan is not None else (), max_model_len=e.max_model_len,
            kv_cache_tokens=e.scheduler.config.kv_cache_tokens if e.scheduler is not None else 0,
            num_steps=s.num_steps, step_seconds=s.step_seconds, compute_seconds=s.compute_seconds,
            scheduler=e.scheduler.stats() if e.scheduler is not None else None, eos_token_ids=c.eos_token_ids,
            scheduling_policy=c.scheduling_policy, max_waiting_requests=c.max_waiting_requests)

    # -- running --------------------------------------------------------------------------
    async def run(self) -> None:
        """The step loop, with the stages probed beside it; runs until cancelled."""
        self.spawn(self.epochs.probe_loop())
        await self.steps.run()

    async def close(self) -> None:
        """Cancel the background tasks and the steps in flight (run() is its caller's to cancel)."""
        tasks = [*self._tasks, *self.steps.in_flight]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def spawn(self, coro) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task
