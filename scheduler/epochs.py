"""The replica's epochs: forming the pipeline, a stage that fails, the recovery window, probing, rejoin.

A stage that fails ends the epoch and the replica turns unhealthy (new
requests go to other replicas), but its requests are kept, as if preempted:
generated tokens kept, KV gone with the epoch (scheduler.handover.requeue_all). When a
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
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, cast

from scheduler import handover
from scheduler.config import DriverConfig, SchedulerConfig
from scheduler.observe import Observer
from scheduler.pipeline import Pipeline, StageFailure
from scheduler.rendezvous import PipelinePlan, StageInfo
from scheduler.request import RequestOutput
from scheduler.scheduler import Scheduler
from scheduler.tiers import tier_blocks
from scheduler.warmup import warm_up
from stagemesh.core.kv_groups import FULL

if TYPE_CHECKING:
    from scheduler.grpc_pipeline import GrpcPipeline

log = logging.getLogger("stagemesh.scheduler")


def kv_cache_too_small(max_model_len: int, kv_tokens: int) -> str:
    """vLLM's refusal of a max_model_len the KV cache cannot hold for one request, in stagemesh's flags."""
    return (f"The model's max seq len ({max_model_len}) is larger than the maximum number of tokens that can be "
            f"stored in KV cache ({kv_tokens}). Based on the available memory, the estimated maximum model length "
            f"is {kv_tokens}. Try increasing --kv-cache-memory (or --gpu-memory-utilization on GPUs) or decreasing "
            "--max-model-len.")


class EpochManager:
    """Owns the pipeline the replica runs on: the epoch's number, plan, context length and scheduler, and
    whether (and why not) the replica can serve. Only this class writes them; the step loop reads them and
    reports a step that broke the pipeline (fail)."""

    def __init__(self, cfg: DriverConfig, pipeline: Pipeline, observer: Observer,
                 spawn: Callable[..., asyncio.Task], dispatch: Callable[[list[RequestOutput]], None],
                 started: Callable[[PipelinePlan, bool], None]):
        """spawn: runs a background task; dispatch: hands outputs to their requests' sinks; started: a new epoch
        formed (its plan, whether it schedules asynchronously)."""
        self.cfg, self.pipeline, self.observer = cfg, pipeline, observer
        self._spawn, self._dispatch, self._started = spawn, dispatch, started
        # the replica's scheduler: the current epoch's, or the broken one's while its requests are kept
        self.scheduler: Scheduler | None = None
        self.plan: PipelinePlan | None = None
        self.max_model_len = 0
        self.epoch = 0
        self.healthy = False
        self.reason = "waiting for stages to register"
        self.refusal = ""  # the configuration cannot serve at all (set once; the scheduler exits with it)
        self.refused = asyncio.Event()
        self._forming = asyncio.Lock()
        self._recovery: asyncio.Task | None = None  # fails the kept requests when the window ends

    # -- a broken pipeline ----------------------------------------------------------------
    def fail(self, reason: str) -> None:
        """The pipeline broke: the epoch ends, its requests are kept for the next one (or fail)."""
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
        requests = handover.requeue_all(scheduler)
        limit = self.cfg.max_request_retries
        tired = [r.request_id for r in requests if r.num_recoveries > limit]
        if tired:
            self._dispatch(scheduler.fail(tired, f"{reason} (the pipeline broke under this request {limit + 1} "
                                                 f"times; --max-request-retries {limit})"))
        kept = [r.request_id for r in requests if r.num_recoveries <= limit]
        self.observer.stalled(kept, reason)
        log.warning("keeping %d request(s) for up to %gs (--stage-recovery-timeout) until the pipeline re-forms",
                    len(kept), window)
        self._recovery = self._spawn(self._give_up_after(window, scheduler, reason))

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

    # -- forming the pipeline ---------------------------------------------------------------
    async def register_stage(self, stage: StageInfo) -> tuple[int, bool]:
        """A stage's registration or heartbeat (a pipeline of stage services): (stages still missing, whether
        this instance is new here). Raises StagemeshError (the reason) when the stage does not fit."""
        # (only a pipeline of stage services has stages that register: the driver calls this for it alone)
        missing, new, change = await cast("GrpcPipeline", self.pipeline).register(stage)
        if change is not None:
            self.fail(change)
            self._spawn(self.form())
        return missing, new

    async def form(self) -> None:
        """Start a new epoch once every stage is there and answers."""
        async with self._forming:
            if self.healthy or self.refused.is_set():
                return
            plan = self.pipeline.layout()
            if plan is None:
                return
            max_len = self._max_model_len(plan)
            if max_len is None:
                return
            plan = self._size_tiers(plan)
            if plan is None:
                return
            epoch = self.epoch = self.epoch + 1
            config = self._formed_config(plan, max_len)
            try:
                await self.pipeline.join(epoch, plan, max_len, self.cfg.scheduler.max_num_batched_tokens)
                warm = None
                if self.cfg.warm_up and self.scheduler is None:  # (kept requests resume at once, unwarmed)
                    self.reason = "warming up"
                    warm = await warm_up(self.pipeline, epoch, config)
            except StageFailure as err:
                self.reason = f"pipeline did not form: {err}"
                log.error("%s", self.reason)
                return
            self._start(plan, config, warm)

    def _max_model_len(self, plan: PipelinePlan) -> int | None:
        """The pipeline's context length, or None (the reason set) if none fits. The first pipeline too small
        for --max-model-len refuses the configuration (vLLM refuses to start); a later, smaller one (a stage
        restarted with less memory) is waited out, its requests kept."""
        kv_tokens = replace(self.cfg.scheduler, num_kv_blocks=plan.num_kv_blocks, block_size=self.pipeline.block_size,
                            kv_group_windows=plan.kv_group_windows).kv_cache_tokens
        max_len = self.cfg.scheduler.max_model_len or min(self.cfg.model_max_len, kv_tokens)
        if max_len <= kv_tokens:
            return max_len
        if self.plan is None:
            self.reason = self.refusal = kv_cache_too_small(max_len, kv_tokens)  # (said by the scheduler's exit)
            self.refused.set()
            return None
        self.reason = (f"--max-model-len {max_len} does not fit the KV cache of {kv_tokens:,} tokens; "
                       "lower it or give the stages more KV memory")
        log.error("%s", self.reason)
        return None

    def _size_tiers(self, plan: PipelinePlan) -> PipelinePlan | None:
        """The plan with its KV tiers' blocks (scheduler.tiers): --kv-offloading-size and
        --kv-offloading-disk-size over every stage's block; None (the configuration refused) when the stages
        cannot have them."""
        host, disk = self.cfg.kv_offloading_bytes, self.cfg.kv_offloading_disk_bytes
        if not host and not disk:
            return plan
        per_block = sum(s.kv_bytes_per_block for s in plan.stages)
        refusal = ""
        if not self.cfg.scheduler.enable_prefix_caching:
            refusal = "the KV tiers hold prefix-cache blocks: --kv-offloading-size needs --enable-prefix-caching"
        elif plan.kv_group_windows != (FULL,):
            refusal = ("the KV tiers do not carry the hybrid KV cache manager's groups (a block table per group of "
                       "sliding-window layers) yet: start the stages with --disable-hybrid-kv-cache-manager (serve "
                       "does so with --kv-offloading-size)")
        elif disk and not host:
            refusal = ("--kv-offloading-disk-size needs --kv-offloading-size: blocks reach the disk tier through the "
                       "host tier")
        elif any(not s.kv_bytes_per_block for s in plan.stages):
            refusal = "a stage did not report the size of its KV blocks (an older stagemesh): no KV tiers"
        elif disk and not all(s.kv_disk_tier for s in plan.stages):
            missing = next(s for s in plan.stages if not s.kv_disk_tier)
            refusal = (f"--kv-offloading-disk-size needs a disk tier on every stage; {missing.name} was started "
                       "without --kv-offloading-disk-path")
        elif not tier_blocks(host or disk, per_block) or (host and disk and not tier_blocks(disk, per_block)):
            refusal = (f"--kv-offloading-size / --kv-offloading-disk-size hold no KV block of {per_block:,} bytes "
                       "(every stage's layers and TP ranks together)")
        if refusal:
            if self.plan is None:
                self.reason = self.refusal = refusal
                self.refused.set()
            else:
                self.reason = refusal
                log.error("%s", refusal)
            return None
        return replace(plan, num_host_kv_blocks=tier_blocks(host, per_block),
                       num_disk_kv_blocks=tier_blocks(disk, per_block))

    def _formed_config(self, plan: PipelinePlan, max_len: int) -> SchedulerConfig:
        """The scheduler's settings for an epoch of `plan`."""
        # CPU stages use every core for the model; overlapping the scheduler, router and client work with
        # it was measured slower there (benchmarks/RESULTS.md, 2026-11-23 async scheduling), so on CPU it
        # is on only when asked for
        async_scheduling = self.cfg.async_scheduling
        if async_scheduling is None:  # (speculation refuses it: scheduler.config)
            async_scheduling = all(s.device.startswith("cuda") for s in plan.stages) and \
                self.cfg.scheduler.speculative is None
        return replace(self.cfg.scheduler, num_kv_blocks=plan.num_kv_blocks, max_model_len=max_len,
                       block_size=self.pipeline.block_size, async_scheduling=async_scheduling,
                       num_host_kv_blocks=plan.num_host_kv_blocks, num_disk_kv_blocks=plan.num_disk_kv_blocks,
                       pooling_tasks=plan.stages[-1].pooling_tasks, kv_group_windows=plan.kv_group_windows)

    def _start(self, plan: PipelinePlan, config: SchedulerConfig, warm: Scheduler | None) -> None:
        """The epoch serves: its scheduler made (after the warm-up's steps, or taking over the kept requests)."""
        block_size, max_len, async_scheduling = config.block_size, config.max_model_len or 0, config.async_scheduling
        disk_hashes = getattr(self.pipeline, "disk_block_hashes", ())  # what the disk tier kept from before
        kept, self.scheduler = self.scheduler, Scheduler(config, disk_hashes)
        if warm is not None:
            handover.continue_after(self.scheduler, warm)
        if self._recovery is not None:
            self._recovery.cancel()
            self._recovery = None
        if kept is not None:  # the requests kept through the broken epoch go on in this one
            self._dispatch(handover.take_over(self.scheduler, kept))
            log.info("resuming %d request(s) kept from the broken epoch", self.scheduler.num_unfinished)
        self.plan, self.max_model_len = plan, max_len
        for s in plan.stages:
            log.info("stage %d: layers %d:%d, %d rank(s), %s, %s handoff, at %s", s.stage_index, s.layer_start,
                     s.layer_end, s.tp_size, s.device, s.handoff, s.address)
        kv_tokens = config.kv_cache_tokens
        log.info("KV cache size: %s tokens", f"{kv_tokens:,}")
        self.observer.formed(kv_tokens)
        hybrid = config.kv_group_windows != (FULL,)
        if hybrid:
            log.info("hybrid KV cache manager: %d groups of layers (sliding windows %s), each block one layer of "
                     "every group; a sliding group keeps only its window's blocks", len(config.kv_group_windows),
                     ", ".join(str(w) if w != FULL else "full" for w in config.kv_group_windows))
        concurrency = self.scheduler.kv.num_blocks / config.kv_blocks_for(max_len) if hybrid else kv_tokens / max_len
        log.info("Maximum concurrency for %s tokens per request: %.2fx", f"{max_len:,}", concurrency)
        per_token = sum(s.kv_bytes_per_block for s in plan.stages) // block_size
        dtype = plan.stages[0].kv_cache_dtype
        log.info("KV cache dtype %s (--kv-cache-dtype): %s bytes per token over every stage and rank", dtype,
                 f"{per_token:,}")
        self.observer.cache_config(dtype, block_size, plan.num_kv_blocks, per_token)
        if plan.num_host_kv_blocks or plan.num_disk_kv_blocks:
            log.info("KV tiers: host %s tokens (%d blocks), disk %s tokens (%d blocks, %d held from before)",
                     f"{plan.num_host_kv_blocks * block_size:,}", plan.num_host_kv_blocks,
                     f"{plan.num_disk_kv_blocks * block_size:,}", plan.num_disk_kv_blocks,
                     min(len(disk_hashes), plan.num_disk_kv_blocks))
        self.healthy, self.reason = True, ""
        spec = self.cfg.scheduler.speculative
        log.info("pipeline formed (epoch %d): %d stage(s), world size %d%s%s", self.epoch, len(plan.stages),
                 plan.world_size, ", async scheduling" if async_scheduling else "",
                 f", speculative decoding: {spec.describe()}" if spec is not None else "")
        self._started(plan, async_scheduling)

    # -- probing ------------------------------------------------------------------------------
    async def probe_loop(self) -> None:
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
                    self.fail(str(failed))
                elif not self.healthy and not self._forming.locked():
                    await self.form()
            except Exception:  # noqa: BLE001 - a bug must not end the probing: the next round tries again
                log.exception("probing the stages failed")
