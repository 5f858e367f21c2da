"""Continuous batching in vLLM v1's style: no prefill or decode phase.

Each request has its tokens (prompt + output) and num_computed_tokens;
schedule() hands out tokens under a per-step budget, running requests first,
then waiting ones, so chunked prefill, decodes and prefix-cache hits follow
one rule. Requests in flight (scheduled, result not yet back) are skipped, so
a pipeline can keep several micro-batches in flight on disjoint sequences.
Preemption is by recompute: the victim frees its blocks and waits again.

Asynchronous scheduling (vLLM's --async-scheduling): a request whose step
in flight samples a token may be scheduled once more before that token is
back, as a decode of PLACEHOLDER (Request.num_output_placeholders counts the
tokens not yet known), which the first stage replaces with the token the last
stage sampled for the sequence in the step before (stages run steps in order;
stage_worker.step_executor.RunAhead). So the next step is on the stages before the current one
ends, and the scheduler's work and both RPCs overlap the model. A request
that turns out to have finished (EOS, stop token) wastes the one token
computed ahead; its result is dropped. schedule(run_ahead=False) leaves such
requests out (a pipeline runs ahead only where a micro-batch would be empty).

Speculative decoding (--speculative-config, scheduler.speculation): a decode step carries the
request's last token and its draft tokens as one chunk; the last stage verifies them and returns 1..k+1
tokens, appended one by one under the stop conditions; num_computed_tokens rolls back over the rejected.

The queues' order, and so who gets the budget first and who is preempted, is the scheduling policy's
(scheduler.policy: fcfs or priority).
"""
from __future__ import annotations

from collections.abc import Sequence

import itertools
import time
from collections import Counter, deque
from dataclasses import dataclass, field

from scheduler import results
from scheduler.admission import check_generated_logprobs, check_request, fits_kv_cache
from scheduler.block_manager import BlockManager
from scheduler.config import SchedulerConfig
from scheduler.kv_transfer import KVLoadFailed, KVTransfers, failure_message
from scheduler.lora_slots import LoRASlots
from stagemesh.core.engine_request import EngineRequest, KVSourceInfo
from scheduler.policy import SchedulingPolicy
from scheduler.request import Request, RequestOutput, Status
from scheduler.speculation import SpecDecodeStats, Speculator
from scheduler.tiers import KVTiers, LoadJob
from stagemesh.core.errors import StagemeshError
from stagemesh.core.step import PLACEHOLDER, NewSequence, PromptLogprobs, SampledToken, ScheduledChunks, StepBatch



@dataclass
class SchedulerOutput:
    step_batch: StepBatch
    request_ids: list[str]  # in chunk order
    num_preempted: int = 0


@dataclass
class SchedulerStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_kv_blocks: int
    num_preemptions: int = 0
    spec_decode: SpecDecodeStats | None = None  # with --speculative-config
    tier_blocks: dict[str, int] = field(default_factory=dict)  # KV tier -> blocks it holds (scheduler.tiers)
    # --enable-lora: the adapters of the running and of the waiting requests (vLLM's lora_requests_info)
    running_adapters: tuple[str, ...] = ()
    waiting_adapters: tuple[str, ...] = ()


@dataclass
class _Budget:
    tokens: int
    seqs: int
    run_ahead: bool = False  # may schedule a step ahead of a request's step in flight
    chunks: ScheduledChunks = field(default_factory=ScheduledChunks)
    new_sequences: list[NewSequence] = field(default_factory=list)
    request_ids: list[str] = field(default_factory=list)


class Scheduler:
    def __init__(self, config: SchedulerConfig, disk_block_hashes=()):
        """disk_block_hashes: the blocks the stages' disk tiers hold already (a restart on the same directory)."""
        self.max_model_len = config.check_formed()
        self.config = config
        self.kv = BlockManager(config.num_kv_blocks, config.block_size, config.enable_prefix_caching)
        if config.enable_prefix_caching and (config.num_host_kv_blocks or config.num_disk_kv_blocks):
            self.kv.tiers = KVTiers(self.kv, config.num_host_kv_blocks, config.num_disk_kv_blocks, disk_block_hashes)
        self.policy = SchedulingPolicy(config.scheduling_policy)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._finished_seq_ids: list[int] = []
        self._seq_ids = itertools.count()
        self._step_ids = itertools.count()
        # ids of preempted requests, for tracing; the driver drains it
        self.recent_preemptions: deque[str] = deque(maxlen=4096)
        self.num_preemptions = 0
        self.transfers = KVTransfers(config.kv_hold_timeout_s)  # disaggregated prefill's holds and pulls
        self.spec = Speculator(config.speculative, self.max_model_len) if config.speculative else None
        self.lora_slots = LoRASlots()  # --max-loras: which waiting request's adapter may start

    def continue_after(self, warm: Scheduler) -> None:
        """`warm` ran steps in this epoch before this scheduler (scheduler.warmup): its step and sequence ids stay
        spent on the stages, and its finished sequences are dropped there with this scheduler's first step."""
        self._step_ids = itertools.count(next(warm._step_ids))
        self._seq_ids = itertools.count(next(warm._seq_ids))
        self._finished_seq_ids = [*warm._finished_seq_ids, *self._finished_seq_ids]

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
        check_request(cfg, request_id, r.prompt_token_ids, r.sampling, r.generated_token_ids)
        check_generated_logprobs(r.generated_token_ids, r.generated_logprobs, r.sampling)
        self.policy.check(r.priority)
        if r.lora_name and (cfg.lora is None or r.lora_name not in cfg.lora):
            raise StagemeshError(f"the LoRA adapter {r.lora_name[:200]!r} is not served by this replica"
                                 + ("" if cfg.lora is not None else " (it runs without --enable-lora)"))
        if request_id in self.requests or self.transfers.in_use(request_id):
            raise StagemeshError(f"request id {request_id!r} is already in use")
        if r.prefill_only and (kv_source is not None or r.generated_token_ids):
            raise StagemeshError("a prefill_only request computes its own prompt: no kv_transfer or generated "
                                 "tokens with it")
        if cfg.max_waiting_requests and len(self.waiting) >= cfg.max_waiting_requests:
            raise QueueFull(f"the waiting queue is full ({cfg.max_waiting_requests} requests)")
        request = Request.of(r)
        usable = kv_source is None or self._kv_source_fits(kv_source, request)
        if not usable and cfg.kv_load_failure_policy == "fail":
            assert kv_source is not None
            raise KVLoadFailed(failure_message(
                request_id, kv_source.scheduler_address, "not_fit", f"the KV held there ({kv_source.num_tokens} "
                f"tokens in blocks of {kv_source.block_size}) does not fit this replica (a prompt of "
                f"{len(r.prompt_token_ids)}, blocks of {cfg.block_size}, no prompt logprobs, no draft model)"))
        if kv_source is not None and usable:
            request.kv_source = kv_source
        self.requests[request_id] = request
        self.policy.enqueue(self.waiting, request)
        return usable

    def _kv_source_fits(self, src: KVSourceInfo, request: Request) -> bool:
        """The held KV is exactly the prompt's, in blocks of this replica's size, with the first token after it;
        not with a draft model, whose own KV cache mirrors only what the target computes here."""
        if self.spec is not None and self.spec.config.uses_draft_model:
            return False
        return (src.block_size == self.config.block_size and src.num_tokens == len(request.prompt_token_ids)
                and len(src.block_ids) == self.kv.blocks_needed(src.num_tokens) and bool(request.output_token_ids)
                and request.sampling.prompt_logprobs is None)

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
        tiers = self.kv.tiers
        if tiers is None or job.request_id not in tiers.loading:
            return
        good = tiers.loaded(job, flags)
        request = tiers.loading.pop(job.request_id)
        if request is None:  # it ended during the load: only now may its blocks go to another request
            self.kv.free_request(job.request_id)
            return
        num_pooled = len(self.kv.tables[job.request_id]) - len(job.block_ids)
        request.num_computed_tokens = (num_pooled + good) * self.config.block_size
        self.kv.cache_full_blocks(job.request_id, request.all_token_ids, request.num_computed_tokens,
                                  request.hash_root)
        request.kv_ready = True
        self.waiting.appendleft(request)

    # -- a broken pipeline (docs/recovery.md): the old epoch's scheduler requeues, the next one's takes over ---
    def requeue_all(self) -> list[Request]:
        """Every request goes back to waiting, as if preempted (generated tokens kept, its KV gone with the
        epoch), running ones first, until a scheduler of the next epoch takes them over (take_over) or they fail
        (fail_all). Nothing a step in flight computed was streamed, so recomputing loses and repeats nothing
        (a seeded request draws by (seed, position); drafts are proposed again). Returns them."""
        for r in self.running:  # (a waiting one lost no work)
            r.num_recoveries += 1
        loading = self.kv.tiers.pending() if self.kv.tiers is not None else []
        requests = self.policy.order([*self.running, *self.waiting, *self.transfers.pending(), *loading])
        releases = self.transfers.take_releases()  # (the KV prefill replicas hold for requests gone: still released)
        self.transfers = KVTransfers(self.config.kv_hold_timeout_s)  # held KV and pulls end with the cache
        # a request whose prompt KV a prefill replica holds computes it again here: that KV may be freed
        releases += [r.kv_source for r in requests if r.kv_source is not None]
        for r in requests:
            r.restart()
        self.transfers.requeue_releases(releases)
        self.running, self.waiting = [], deque(requests)
        self._finished_seq_ids = []
        self.kv = BlockManager(self.config.num_kv_blocks, self.config.block_size, self.config.enable_prefix_caching)
        return requests

    def take_over(self, old: Scheduler) -> list[RequestOutput]:
        """Adopt the requests `old` kept (after its requeue_all), in their order; those that no longer fit this
        epoch's context length or KV cache fail (their outputs are returned)."""
        assert not old.running, "take_over needs the old scheduler's requests requeued"
        failed, cfg = [], self.config
        for request in old.waiting:
            total = len(request.prompt_token_ids) + request.sampling.max_tokens
            if total > self.max_model_len or not fits_kv_cache(cfg, total):
                request.status = Status.FINISHED
                failed.append(RequestOutput(
                    request.request_id, finish_reason="error", num_prompt_tokens=len(request.prompt_token_ids),
                    error=f"the pipeline re-formed with room for {self.max_model_len} tokens per request "
                          f"and a KV cache of {cfg.kv_cache_tokens}; this request needs {total}"))
                continue
            self.requests[request.request_id] = request
            self.policy.enqueue(self.waiting, request)
        old.requests, old.waiting = {}, deque()
        self.transfers.requeue_releases(old.transfers.take_releases())
        return failed

    def fail(self, request_ids, error: str, own_fault: bool = False) -> list[RequestOutput]:
        """End these requests with `error` (own_fault: their own data failed them, never to be retried)."""
        return [self.finish(self.requests[r], "error", error=error, own_fault=own_fault) for r in request_ids
                if r in self.requests]

    def wait_for_grammar(self, request_id: str, waiting: bool) -> None:
        """A structured request waits, unscheduled, while its constraint compiles (vLLM's WAITING_FOR_FSM)."""
        request = self.requests.get(request_id)
        if request is not None:
            request.waiting_for_grammar = waiting

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
        self._finished_seq_ids.clear()
        return outputs

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    def stats(self) -> SchedulerStats:
        tiers = self.kv.tiers
        return SchedulerStats(len(self.running), len(self.waiting), self.kv.usage, self.kv.prefix_queries,
                              self.kv.prefix_hits, self.kv.num_blocks, self.num_preemptions,
                              self.spec.stats if self.spec is not None else None,
                              {"host": len(tiers.host), "disk": len(tiers.disk)} if tiers is not None else {},
                              *self._adapters())

    def _adapters(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        if self.config.lora is None:
            return (), ()
        return (tuple(sorted({r.lora_name for r in self.running if r.lora_name})),
                tuple(sorted({r.lora_name for r in self.waiting if r.lora_name})))

    # -- one step -------------------------------------------------------------
    def schedule(self, max_seqs: int | None = None, run_ahead: bool = True) -> SchedulerOutput | None:
        """One step's micro-batch; max_seqs caps its sequences (a pipeline splits the running ones
        over its micro-batches so that every stage has work); run_ahead=False: no step ahead of a
        request's step in flight, even with async scheduling."""
        budget = _Budget(self.config.max_num_batched_tokens, max_seqs or self.config.max_num_seqs,
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
        batch = StepBatch(next(self._step_ids), budget.new_sequences, budget.chunks, self._finished_seq_ids)
        self._finished_seq_ids = []
        return SchedulerOutput(batch, budget.request_ids, preempted)

    def _schedule_running(self, budget: _Budget) -> int:
        preempted = 0
        for request in list(self.running):
            if budget.tokens <= 0 or len(budget.chunks) >= budget.seqs:
                break
            if request.status is not Status.RUNNING:
                continue
            if request.in_flight and not (budget.run_ahead and self._can_run_ahead(request)):
                continue
            num_new = request.num_tokens + request.num_output_placeholders - request.num_computed_tokens
            decode = num_new == 1 and not request.num_output_placeholders
            drafts = self.spec.drafts(request) if self.spec is not None and decode else []
            num_new = min(num_new + len(drafts), budget.tokens)
            drafts = drafts[:num_new - 1]  # the budget may cut them
            need = self._kv_tokens(request, num_new, len(drafts))
            new_blocks = self.kv.allocate(request.request_id, need)
            if new_blocks is None and request.in_flight:
                continue  # a step ahead never preempts: the request waits for its result instead
            while new_blocks is None:
                victim = self._pick_victim()
                if victim is None:
                    break
                self._preempt(victim)
                preempted += 1
                if victim is request:
                    break
                new_blocks = self.kv.allocate(request.request_id, need)
            if new_blocks is None or request.status is not Status.RUNNING:
                continue
            self._add_chunk(budget, request, num_new, new_blocks, drafts)
        return preempted

    def _make_room(self) -> int:
        """Priority policy: the first waiting request, if its first chunk lacks KV blocks, preempts running
        requests of lower priority (the lowest first) until it fits, before the step is built; returns how
        many. It is then admitted in this step unless a running request of higher priority takes the room."""
        if not self.waiting or not self.policy.by_priority:
            return 0
        head, preempted = self.waiting[0], 0
        while not self.kv.can_allocate(head.request_id, *self._first_chunk(head, self.config.max_num_batched_tokens)):
            victim = self.policy.victim_for(self.running, head)
            if victim is None:
                break
            self._preempt(victim)
            preempted += 1
        return preempted

    def _first_chunk(self, request: Request, tokens: int) -> tuple[int, list[int]]:
        """(tokens the waiting request's first chunk fills, counted from position 0; its cached blocks)."""
        # a request that scores its prompt needs every position computed: no prefix-cache hit (as vLLM)
        cached = [] if request.sampling.prompt_logprobs is not None else \
            self.kv.find_cached_prefix(request.all_token_ids, request.hash_root)
        num_cached = len(cached) * self.config.block_size
        return num_cached + min(request.num_tokens - num_cached, tokens), cached

    def _schedule_waiting(self, budget: _Budget) -> None:
        skipped: list[Request] = []  # requests that cannot start yet: they keep their places in the queue
        try:
            self._admit_waiting(budget, skipped)
        finally:
            self.waiting.extendleft(reversed(skipped))

    def _admit_waiting(self, budget: _Budget, skipped: list[Request]) -> None:
        # at most --max-loras adapters run at once (scheduler.lora_slots; counted per step only when LoRA is on)
        lora = self.config.lora
        busy = self.lora_slots.busy(self.running) if lora is not None else Counter[str]()
        while (self.waiting and budget.tokens > 0 and len(self.running) < self.config.max_num_seqs
               and len(budget.chunks) < budget.seqs):
            request = self.waiting[0]
            if request.waiting_for_grammar or (lora is not None and not self.lora_slots.admits(request, busy,
                                                                                               lora.max_loras)):
                skipped.append(self.waiting.popleft())  # its constraint compiles, or its adapter has no slot
                continue
            if request.kv_source is not None:  # its prompt's KV is elsewhere: blocks for it, then the pull
                blocks = self.kv.allocate(request.request_id, request.kv_source.num_tokens)
                if blocks is None:
                    if self._unblock():
                        continue
                    break
                self.transfers.start_pull(self.waiting.popleft(), blocks)
                continue
            if self._load_from_tiers(request):
                continue
            if request.kv_ready:  # pulled: its blocks hold the prompt; the stages get every one of them
                num_cached, num_new = request.num_computed_tokens, min(request.num_tokens - request.num_computed_tokens,
                                                                      budget.tokens)
                if self.kv.allocate(request.request_id, self._kv_tokens(request, num_new, 0, num_cached)) is None:
                    if self._unblock():
                        continue
                    break
                new_blocks, request.kv_ready = list(self.kv.tables[request.request_id]), False
            else:
                num_tokens, cached = self._first_chunk(request, budget.tokens)
                num_cached = len(cached) * self.config.block_size
                num_new = num_tokens - num_cached
                allocated = self.kv.allocate(request.request_id, self._kv_tokens(request, num_new, 0, num_cached),
                                             cached)
                if allocated is None:
                    if self._unblock():
                        continue
                    break
                new_blocks = allocated
            self.waiting.popleft()
            if self.config.enable_prefix_caching:
                self.kv.record_prefix_lookup(request.num_tokens, num_cached)
            request.status = Status.RUNNING
            request.seq_id = next(self._seq_ids)
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
            request.num_computed_tokens = num_cached
            if not request.output_token_ids:
                request.num_cached_tokens = num_cached
            self.policy.add_running(self.running, request)
            if request.lora_name:
                busy[request.lora_name] += 1
            budget.new_sequences.append(NewSequence(request.seq_id, list(request.prompt_token_ids), request.sampling,
                                                    list(request.output_token_ids), request.lora_name))
            self._add_chunk(budget, request, num_new, new_blocks)

    def _unblock(self) -> bool:
        """The first waiting request lacks blocks and nothing runs that would free some: waiting requests whose
        prompt's KV was loaded into blocks of their own (from a KV tier, or pulled from a prefill replica) give
        them back, still in the prefix cache, and are admitted like any request (their prefix found there).
        Without this, a preempted request queued in front of them waits for ever for the blocks they hold.
        Whether any did."""
        if self.running:
            return False
        held = [r for r in self.waiting if r.kv_ready and r.request_id in self.kv.tables]
        for r in held:
            self.kv.free_request(r.request_id)
            r.kv_ready, r.num_computed_tokens, r.tiers_checked = False, 0, False
        return bool(held)

    def _load_from_tiers(self, request: Request) -> bool:
        """Whether the waiting request at the head went loading blocks of its prompt from the KV tiers (it
        comes back with kv_ready: scheduler.tiers). Looked up once per admission."""
        tiers = self.kv.tiers
        if tiers is None or request.kv_ready or request.tiers_checked or request.sampling.prompt_logprobs is not None:
            return False
        request.tiers_checked = True
        bs = self.config.block_size
        cached = self.kv.find_cached_prefix(request.all_token_ids, request.hash_root)
        hits = tiers.lookup(request.all_token_ids, len(cached), bs, request.hash_root)
        if not hits:
            return False
        blocks = self.kv.allocate(request.request_id, (len(cached) + len(hits)) * bs, cached)
        if blocks is None:  # no room yet: looked up again when there is
            request.tiers_checked = False
            return False
        tiers.start_load(self.waiting.popleft(), blocks[len(cached):], hits)
        return True

    def _can_run_ahead(self, request: Request) -> bool:
        """Async scheduling: one step ahead of a request whose step in flight samples, unless that
        token is sure to be its last."""
        p = request.sampling
        return (request.in_flight == 1 and request.num_output_placeholders == 1
                and len(request.output_token_ids) + 1 < p.max_tokens
                and request.num_tokens + 1 < self.max_model_len)

    def _kv_tokens(self, request: Request, num_new: int, num_drafts: int, start: int | None = None) -> int:
        """The tokens the request's KV blocks must hold for a chunk of num_new tokens from `start` (its
        num_computed_tokens), with a draft model's lookahead when the chunk samples."""
        end = (request.num_computed_tokens if start is None else start) + num_new
        if self.spec is not None and end - num_drafts >= request.num_tokens + request.num_output_placeholders:
            return self.spec.lookahead(request, end)
        return end

    def _add_chunk(self, budget: _Budget, request: Request, num_new: int, new_blocks: list[int],
                   drafts: Sequence[int] = ()) -> None:
        start, known = request.num_computed_tokens, num_new - len(drafts)
        tokens = request.all_token_ids[start:start + known]
        if len(tokens) < known:  # the token sampled by the step in flight: the stage fills it in
            tokens.append(PLACEHOLDER)
        tokens += drafts
        request.num_computed_tokens += num_new
        sample = request.num_computed_tokens - len(drafts) == request.num_tokens + request.num_output_placeholders
        if sample:
            request.num_output_placeholders += 1
        budget.chunks.append(request.seq_id, tokens, start, new_blocks, sample, len(drafts))
        budget.request_ids.append(request.request_id)
        budget.tokens -= num_new

    def _pick_victim(self) -> Request | None:
        """The last running request that is not in flight (its blocks are not in use): the newest under fcfs,
        the lowest-priority (then newest) under the priority policy, the running queue being in that order."""
        for request in reversed(self.running):
            if not request.in_flight:
                return request
        return None

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv.free_request(request.request_id)
        self._finished_seq_ids.append(request.seq_id)
        request.status = Status.WAITING
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.tiers_checked = False
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.recent_preemptions.append(request.request_id)
        self.policy.enqueue(self.waiting, request, preempted=True)

    def update_from_output(self, output: SchedulerOutput, sampled: list[SampledToken],
                           prompt_logprobs: Sequence[PromptLogprobs] = (),
                           drafts: dict[int, list[int]] | None = None) -> list[RequestOutput]:
        """Take a step's result in: each sampling chunk's tokens (1..N+1 for a chunk with N drafts, checked by
        scheduler.pipeline.check_result), prompt logprobs, and a draft model's proposals (scheduler.results)."""
        return results.take_step(self, output.step_batch, output.request_ids, sampled, prompt_logprobs, drafts or {})

    def finish(self, request: Request, reason: str, error: str | None = None, own_fault: bool = False,
                kv_load_failed: bool = False) -> RequestOutput:
        """End a request for `reason` (stop, length, abort, prefilled, error): out of the queues, its sequence
        ended on the stages, its blocks freed (or held for a decode replica: prefilled); returns its output."""
        self.requests.pop(request.request_id, None)
        if request.status is Status.RUNNING:
            self.running.remove(request)
            self._finished_seq_ids.append(request.seq_id)
        elif request.status is Status.WAITING and request in self.waiting:
            self.waiting.remove(request)
        request.status = Status.FINISHED
        if reason == "prefilled":
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
