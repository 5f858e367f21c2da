"""Continuous batching in vLLM v1's style: no prefill or decode phase.

Each request has its tokens (prompt + output) and num_computed_tokens;
schedule() hands out tokens under a per-step budget, running requests first,
then waiting ones, so chunked prefill, decodes and prefix-cache hits follow
one rule. Requests in flight (scheduled, result not yet back) are skipped, so
a pipeline can keep several micro-batches in flight on disjoint sequences.
Preemption is by recompute: the victim frees its blocks and waits again.

Asynchronous scheduling (vLLM's --async-scheduling): a request whose step in flight samples a token may be
scheduled once more before that token is back (scheduler.step_assembly); schedule(run_ahead=False) leaves
such requests out (a pipeline runs ahead only where a micro-batch would be empty).

Speculative decoding (--speculative-config, scheduler.speculation): a decode step carries the
request's last token and its draft tokens as one chunk; the last stage verifies them and returns 1..k+1
tokens, appended one by one under the stop conditions; num_computed_tokens rolls back over the rejected.

The Scheduler coordinates; each concept is its own module: where a request stands (scheduler.status), the
queues' order and who is preempted (scheduler.policy: fcfs or priority, within each tenant; across tenants,
its fair share by weight), the blocks a request holds and needs and where its KV comes from
(scheduler.kv_accounting, scheduler.kv_sources), and the step built from the chosen requests
(scheduler.step_assembly). Its requests handed on to another scheduler (a broken pipeline's next epoch, another
replica) are scheduler.handover's; what it reports of itself, scheduler.stats'.
"""
from __future__ import annotations

import itertools
import time
from collections import Counter, deque
from collections.abc import Sequence

from scheduler import results
from scheduler.admission import check_engine_request
from scheduler.block_manager import BlockManager
from scheduler.config import SchedulerConfig
from scheduler.kv_accounting import KVAccounting, Placement
from scheduler.kv_transfer import KVLoadFailed, KVTransfers, not_fit_message
from scheduler.lora_slots import LoRASlots
from scheduler.policy import SchedulingPolicy
from scheduler.request import Request, RequestOutput
from scheduler.speculation import Speculator
from scheduler.stats import SchedulerStats, snapshot
from scheduler.status import Status
from scheduler.step_assembly import SchedulerOutput, StepBudget, can_run_ahead, next_chunk
from scheduler.tiers import KVTiers, LoadJob
from stagemesh.core.engine_request import EngineRequest
from stagemesh.core.errors import StagemeshError
from stagemesh.core.step import PromptLogprobs, SampledToken


def kv_pool(config: SchedulerConfig) -> BlockManager:
    """The replica's pool of KV blocks, with a table per KV cache group."""
    return BlockManager(config.num_kv_blocks, config.block_size, config.enable_prefix_caching,
                        config.kv_group_windows, config.kv_lookback)


class Scheduler:
    def __init__(self, config: SchedulerConfig, disk_block_hashes=()):
        """disk_block_hashes: the blocks the stages' disk tiers hold already (a restart on the same directory)."""
        self.max_model_len = config.check_formed()
        self.config = config
        self.kv = kv_pool(config)
        if config.enable_prefix_caching and (config.num_host_kv_blocks or config.num_disk_kv_blocks):
            self.kv.tiers = KVTiers(self.kv, config.num_host_kv_blocks, config.num_disk_kv_blocks, disk_block_hashes)
        self.policy = SchedulingPolicy(config.scheduling_policy, config.tenant_fair_share)
        self.waiting = self.policy.waiting()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        # the ids the stages know: sequences ended since the last step (it tells the stages to drop them), and
        # the next sequence's and step's (scheduler.handover carries them on from the warm-up's scheduler)
        self.finished_seq_ids: list[int] = []
        self.new_seq_ids = itertools.count()
        self.new_step_ids = itertools.count()
        # ids of preempted requests, for tracing; the driver drains it
        self.recent_preemptions: deque[str] = deque(maxlen=4096)
        self.num_preemptions = 0
        self.transfers = KVTransfers(config.kv_hold_timeout_s)  # disaggregated prefill's holds and pulls
        self.spec = Speculator(config.speculative, self.max_model_len) if config.speculative else None
        self.lora_slots = LoRASlots()  # --max-loras: which waiting request's adapter may start
        self.accounting = KVAccounting(self.kv, self.transfers, self.spec)  # blocks held and needed; KV sources

    # -- requests in and out ------------------------------------------------
    def add_request(self, r: EngineRequest) -> bool:
        """Queue a request. A continuation (generated_token_ids: it produced those tokens elsewhere, its replica
        failed) goes on from prompt + them as if it had generated them here (max_tokens, min_tokens, a seed's
        positions and a structured-output grammar count them; its prompt logprobs were delivered). priority:
        lower is served first (--scheduling-policy priority; any other value than 0 is refused under fcfs, as
        vLLM refuses it). prefill_only / kv_source: disaggregated prefill (scheduler.kv_transfer). lora_name:
        one of config.lora's adapters. Returns False when a kv_source cannot be used here and the
        kv_load_failure_policy is recompute (the prompt is then computed here); under fail that raises
        KVLoadFailed."""
        cfg, request_id, kv_source = self.config, r.request_id, r.kv_source
        check_engine_request(cfg, r)
        self.policy.check(r.priority, r.tenant, r.tenant_weight)
        if request_id in self.requests or self.transfers.in_use(request_id):
            raise StagemeshError(f"request id {request_id!r} is already in use")
        if cfg.max_waiting_requests and len(self.waiting) >= cfg.max_waiting_requests:
            raise QueueFull(f"the waiting queue is full ({cfg.max_waiting_requests} requests)")
        request = Request.of(r)
        usable = kv_source is None or self.accounting.kv_source_fits(kv_source, request)
        if not usable and cfg.kv_load_failure_policy == "fail":
            assert kv_source is not None
            raise KVLoadFailed(not_fit_message(request_id, kv_source, request.num_tokens - 1, cfg.block_size))
        if kv_source is not None and usable:
            request.kv_source = kv_source
        self.requests[request_id] = request
        self.policy.arrived(request)
        self.waiting.add(request)
        return usable

    def release_kv(self, request_id: str) -> bool:
        """A decode replica is done with a prefilled request's KV here: free its blocks."""
        return self.transfers.release(self.kv, request_id)

    def kv_pulled(self, request_id: str, ok: bool, error: str = "") -> list[RequestOutput]:
        """The driver's pull of a request's prompt KV ended (ok: its blocks hold it). Not ok: under the
        kv_load_failure_policy recompute the request computes its prompt; under fail it ends (its output, with
        `error`). The request goes to the front of the waiting queue."""
        request = self.transfers.pulled(self.kv, request_id, ok)
        if request is None:
            return []
        if ok or self.config.kv_load_failure_policy == "recompute":
            self.waiting.appendleft(request)
            return []
        return [self.finish(request, "error", error=error, kv_load_failed=True)]

    def kv_tier_loaded(self, job: LoadJob, flags: list[bool]) -> None:
        """The driver's load of a request's blocks from the KV tiers ended (flags: per block, loaded): it runs
        from the first block that did not load, at the front of the waiting queue."""
        request = self.accounting.tier_loaded(job, flags)
        if request is not None:
            self.waiting.appendleft(request)

    def fail(self, request_ids, error: str, own_fault: bool = False) -> list[RequestOutput]:
        """End these requests with `error` (own_fault: their own data failed them, never to be retried)."""
        return [self.finish(self.requests[r], "error", error=error, own_fault=own_fault) for r in request_ids
                if r in self.requests]

    def wait_for_grammar(self, request_id: str, waiting: bool) -> None:
        """A structured request waits, unscheduled, while its constraint compiles (vLLM's WAITING_FOR_FSM)."""
        request = self.requests.get(request_id)
        if request is None:
            return
        if waiting and request.status.is_waiting:
            request.status = Status.WAITING_FOR_GRAMMAR
        elif not waiting and request.status is Status.WAITING_FOR_GRAMMAR:
            request.status = Status.WAITING

    def abort(self, request_ids) -> list[RequestOutput]:
        outputs = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is not None:
                outputs.append(self.finish(request, "abort"))
        return outputs

    def fail_all(self, error: str) -> list[RequestOutput]:
        """The pipeline broke: every request ends with `error` (their KV is gone with the epoch)."""
        outputs = [self.finish(r, "error", error=error) for r in list(self.requests.values())]
        self.finished_seq_ids.clear()
        return outputs

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    def stats(self) -> SchedulerStats:
        return snapshot(self)

    # -- one step -------------------------------------------------------------
    def schedule(self, max_seqs: int | None = None, run_ahead: bool = True) -> SchedulerOutput | None:
        """One step's micro-batch; max_seqs caps its sequences (a pipeline splits the running ones
        over its micro-batches so that every stage has work); run_ahead=False: no step ahead of a
        request's step in flight, even with async scheduling."""
        budget = StepBudget(self.config.max_num_batched_tokens, max_seqs or self.config.max_num_seqs,
                            run_ahead and self.config.async_scheduling)
        made_room = self._make_room()
        preempted = self._schedule_running(budget)
        # a request preempted in this step does not come straight back, unless the step would be empty (then
        # nothing would run, and nothing wake the loop, until a new request came)
        if not preempted or not budget.chunks:
            self._schedule_waiting(budget)
        preempted += made_room
        if not budget.chunks:
            return None
        for request_id in budget.request_ids:
            self.requests[request_id].in_flight += 1
        batch = budget.batch(next(self.new_step_ids), self.finished_seq_ids)
        self.finished_seq_ids = []
        return SchedulerOutput(batch, budget.request_ids, preempted)

    def _schedule_running(self, budget: StepBudget) -> int:
        preempted = 0
        for request in list(self.running):
            if budget.full:
                break
            if request.status is not Status.RUNNING or request.yield_slot:
                continue
            if request.in_flight and not (budget.run_ahead and can_run_ahead(request, self.max_model_len)):
                continue
            num_new, drafts = next_chunk(request, budget.tokens, self.spec)
            self.kv.free_outside_window(request.request_id, request.num_computed_tokens)
            need = self.accounting.kv_tokens(request, num_new, len(drafts))
            new_blocks = self.kv.allocate(request.request_id, need)
            if new_blocks is None and request.in_flight:
                continue  # a step ahead never preempts: the request waits for its result instead
            if new_blocks is None:
                new_blocks, victims = self._preempt_for(request, need)
                preempted += victims
            if new_blocks is None or request.status is not Status.RUNNING:
                continue
            budget.add_chunk(request, num_new, new_blocks, drafts, self.policy.fair)
        return preempted

    def _preempt_for(self, request: Request, need: int) -> tuple[list[int] | None, int]:
        """The running request lacks blocks for `need` tokens: the policy's victims are preempted until it has
        them (it may be the victim itself); its new blocks (None: it has none) and how many were preempted."""
        new_blocks, preempted = None, 0
        while new_blocks is None:
            victim = self.policy.kv_victim(self.running)
            if victim is None:
                break
            self._preempt(victim)
            preempted += 1
            if victim is request:
                break
            new_blocks = self.kv.allocate(request.request_id, need)
        return new_blocks, preempted

    def _make_room(self) -> int:
        """The policy's preemptions for the first waiting request before the step is built (policy.make_room);
        returns how many."""
        if not self.waiting or not (self.policy.by_priority or self.policy.fair is not None):
            return 0
        preempted = 0
        for victim in self.policy.make_room(self.running, self.waiting[0], self._fits, self.config.max_num_seqs):
            self._preempt(victim)
            preempted += 1
        return preempted

    def _fits(self, head: Request) -> bool:
        return self.accounting.fits(head, self.config.max_num_batched_tokens)

    def _schedule_waiting(self, budget: StepBudget) -> None:
        if not self.waiting:  # (a decode step's usual case: nothing to admit, nothing to set up for it)
            return
        skipped: list[Request] = []  # requests that cannot start yet: they keep their places in the queue
        try:
            self._admit_waiting(budget, skipped)
        finally:
            self.waiting.extendleft(reversed(skipped))

    def _admit_waiting(self, budget: StepBudget, skipped: list[Request]) -> None:
        # at most --max-loras adapters run at once (scheduler.lora_slots; counted per step only when LoRA is on)
        busy = self.lora_slots.busy(self.running) if self.config.lora is not None else Counter[str]()
        while self.waiting and not budget.full and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            if not self._may_start(request, busy):
                skipped.append(self.waiting.popleft())  # it keeps its place
                continue
            placed = self.accounting.place(request, budget.tokens)
            if placed is None:  # the pool lacks blocks for it
                if self._unblock():
                    continue
                break
            self.waiting.popleft()
            if isinstance(placed, Placement):
                self._start(request, placed, budget, busy)
            # (else a source brings its KV in: it comes back to the front of the queue once it is there)

    def _may_start(self, request: Request, busy: Counter[str]) -> bool:
        """Whether the request at the head may start as far as its status goes (Status.admissible) and, under
        --max-loras, its adapter (a slot for it, or it waits for one)."""
        if not request.status.admissible:
            return False
        lora = self.config.lora
        if lora is not None and not self.lora_slots.admits(request, busy, lora.max_loras):
            request.status = Status.WAITING_FOR_LORA_SLOT
            return False
        if request.status is Status.WAITING_FOR_LORA_SLOT:
            request.status = Status.WAITING
        return True

    def _start(self, request: Request, placed: Placement, budget: StepBudget, busy: Counter[str]) -> None:
        """The waiting request runs from this step: a new sequence on the stages, its first chunk in the step."""
        if self.config.enable_prefix_caching:
            self.kv.record_prefix_lookup(request.num_tokens, placed.num_cached)
        request.status = Status.RUNNING
        request.seq_id = next(self.new_seq_ids)
        if request.first_scheduled_time is None:
            request.first_scheduled_time = time.monotonic()
        request.num_computed_tokens = placed.num_cached
        if not request.output_token_ids:
            request.num_cached_tokens = placed.num_cached
        self.policy.add_running(self.running, request)
        if request.lora_name:
            busy[request.lora_name] += 1
        budget.add_sequence(request)
        budget.add_chunk(request, placed.num_new, placed.new_blocks, (), self.policy.fair)

    def _unblock(self) -> bool:
        """The first waiting request lacks blocks and nothing runs that would free some: waiting requests whose
        prompt's KV was loaded into blocks of their own (from a KV tier, or pulled from a prefill replica) give
        them back, still in the prefix cache, and are admitted like any request (their prefix found there).
        Without this, a preempted request queued in front of them waits for ever for the blocks they hold.
        Whether any did."""
        return not self.running and self.accounting.give_back_loaded(self.waiting)

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv.free_request(request.request_id)
        self.finished_seq_ids.append(request.seq_id)
        request.status = Status.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.tiers_checked = request.yield_slot = False
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.recent_preemptions.append(request.request_id)
        self.waiting.add(request, preempted=True)

    def update_from_output(self, output: SchedulerOutput, sampled: list[SampledToken],
                           prompt_logprobs: Sequence[PromptLogprobs] = (),
                           drafts: dict[int, list[int]] | None = None) -> list[RequestOutput]:
        """Take a step's result in: each sampling chunk's tokens (1..N+1 for a chunk with N drafts, checked by
        scheduler.pipeline.check_result), prompt logprobs, and a draft model's proposals (scheduler.results)."""
        return results.take_step(self, output.step_batch, output.request_ids, sampled, prompt_logprobs, drafts or {})

    def finish(self, request: Request, reason: str, error: str | None = None, own_fault: bool = False,
               kv_load_failed: bool = False, hold_kv: bool = False) -> RequestOutput:
        """End a request for `reason` (stop, length, abort, prefilled, migrated, error): out of the queues, its
        sequence ended on the stages, its blocks freed (or held for another replica: prefilled, hold_kv);
        returns its output."""
        if self.requests.pop(request.request_id, None) is not None:
            self.policy.left(request)
        if request.status is Status.RUNNING:
            self.running.remove(request)
            self.finished_seq_ids.append(request.seq_id)
        elif request.status.is_waiting and request in self.waiting:
            self.waiting.remove(request)
        request.status = Status.FINISHED
        if reason == "prefilled" or hold_kv:
            self.transfers.hold(request.request_id, time.monotonic())
        elif not self.transfers.abandon(request) and \
                not (self.kv.tiers is not None and self.kv.tiers.abandon(request.request_id)):
            self.kv.free_request(request.request_id)  # (a pull's or a tier load's blocks are freed when it ends)
        return RequestOutput(request.request_id, finish_reason=reason, error=error, own_fault=own_fault,
                             kv_load_failed=kv_load_failed,
                             num_prompt_tokens=len(request.prompt_token_ids),
                             num_cached_tokens=request.num_cached_tokens)


class QueueFull(StagemeshError):
    """The waiting queue is at --max-waiting-requests."""
