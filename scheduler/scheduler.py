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
stage_worker.run_ahead). So the next step is on the stages before the current one
ends, and the scheduler's work and both RPCs overlap the model. A request
that turns out to have finished (EOS, stop token) wastes the one token
computed ahead; its result is dropped. schedule(run_ahead=False) leaves such
requests out (a pipeline runs ahead only where a micro-batch would be empty).

The queues' order, and so who gets the budget first and who is preempted, is the scheduling policy's
(scheduler.policy: fcfs or priority).
"""
from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass, field

from scheduler.block_manager import BlockManager
from scheduler.config import SchedulerConfig
from scheduler.policy import SchedulingPolicy
from scheduler.request import Request, RequestOutput, Status
from stagemesh.core.errors import StagemeshError
from stagemesh.core.sampling_params import SamplingParams, check_token_ids
from stagemesh.core.step import PLACEHOLDER, NewSequence, PromptLogprobs, SampledToken, ScheduledChunks, StepBatch


MAX_REQUEST_ID_LEN = 256


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


@dataclass
class _Budget:
    tokens: int
    seqs: int
    run_ahead: bool = False  # may schedule a step ahead of a request's step in flight
    chunks: ScheduledChunks = field(default_factory=ScheduledChunks)
    new_sequences: list[NewSequence] = field(default_factory=list)
    request_ids: list[str] = field(default_factory=list)


class Scheduler:
    def __init__(self, config: SchedulerConfig):
        config.check_formed()
        self.config = config
        self.kv = BlockManager(config.num_kv_blocks, config.block_size, config.enable_prefix_caching)
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

    # -- requests in and out ------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams,
                    generated_token_ids: list[int] = (), priority: int = 0) -> None:
        """Queue a request; generated_token_ids continues one that produced those tokens elsewhere (its replica
        failed): it goes on from prompt + them as if it had generated them here (max_tokens, min_tokens, a
        seed's positions and a structured-output grammar count them; its prompt logprobs were delivered).
        priority: lower is served first (--scheduling-policy priority; any other value than 0 is refused under
        fcfs, as vLLM refuses it)."""
        cfg = self.config
        if not request_id or len(request_id) > MAX_REQUEST_ID_LEN:
            raise StagemeshError(f"a request id must have 1 to {MAX_REQUEST_ID_LEN} characters")
        self.policy.check(priority)
        if request_id in self.requests:
            raise StagemeshError(f"request id {request_id!r} is already in use")
        if not prompt_token_ids:
            raise StagemeshError("the prompt is empty")
        check_token_ids("prompt_token_ids", prompt_token_ids, cfg.vocab_size)
        check_token_ids("generated_token_ids", generated_token_ids, cfg.vocab_size)
        if len(generated_token_ids) >= sampling.max_tokens:
            raise StagemeshError(f"a continuation of {len(generated_token_ids)} generated tokens has nothing left "
                                 f"to generate (max_tokens {sampling.max_tokens})")
        if cfg.vocab_size is not None:
            sampling.check_vocab(cfg.vocab_size)
        total = len(prompt_token_ids) + sampling.max_tokens
        if total > cfg.max_model_len:
            raise StagemeshError(
                f"this model's maximum context length is {cfg.max_model_len} tokens, but the request asks for "
                f"{total} ({len(prompt_token_ids)} in the prompt + {sampling.max_tokens} max_tokens)"
            )
        if self.kv.blocks_needed(total) > cfg.num_kv_blocks:
            raise StagemeshError(f"a request of {total} tokens can never fit the KV cache of {cfg.kv_cache_tokens} tokens")
        if cfg.max_waiting_requests and len(self.waiting) >= cfg.max_waiting_requests:
            raise QueueFull(f"the waiting queue is full ({cfg.max_waiting_requests} requests)")
        request = Request(request_id, list(prompt_token_ids), sampling, list(generated_token_ids), priority=priority)
        if generated_token_ids:
            request.num_prompt_logprobs = len(prompt_token_ids) - 1
        self.requests[request_id] = request
        self.policy.enqueue(self.waiting, request)

    def requeue_all(self) -> list[Request]:
        """The pipeline broke: every request goes back to waiting as if preempted (generated tokens kept, its KV
        gone with the epoch), running ones first, until a scheduler of the next epoch takes them over
        (take_over) or they fail (fail_all). Returns them."""
        for r in self.running:  # (a waiting one lost no work)
            r.num_recoveries += 1
        requests = self.policy.order([*self.running, *self.waiting])
        for r in requests:
            r.status, r.seq_id = Status.WAITING, -1
            r.num_computed_tokens = r.in_flight = r.num_output_placeholders = 0
        self.running, self.waiting = [], deque(requests)
        self._finished_seq_ids = []
        self.kv = BlockManager(self.config.num_kv_blocks, self.config.block_size, self.config.enable_prefix_caching)
        return requests

    def take_over(self, old: Scheduler) -> list[RequestOutput]:
        """Adopt the requests `old` kept through a broken pipeline (after its requeue_all), in their order;
        those that no longer fit this epoch's context length or KV cache fail (their outputs are returned)."""
        assert not old.running, "take_over needs the old scheduler's requests requeued"
        failed = []
        for request in old.waiting:
            total = len(request.prompt_token_ids) + request.sampling.max_tokens
            if total > self.config.max_model_len or self.kv.blocks_needed(total) > self.config.num_kv_blocks:
                request.status = Status.FINISHED
                failed.append(RequestOutput(
                    request.request_id, finish_reason="error", num_prompt_tokens=len(request.prompt_token_ids),
                    error=f"the pipeline re-formed with room for {self.config.max_model_len} tokens per request "
                          f"and a KV cache of {self.config.kv_cache_tokens}; this request needs {total}"))
                continue
            self.requests[request.request_id] = request
            self.policy.enqueue(self.waiting, request)
        old.requests, old.waiting = {}, deque()
        return failed

    def fail(self, request_ids, error: str) -> list[RequestOutput]:
        """End these requests with `error` (not their own fault)."""
        return [self._finish(self.requests[r], "error", error=error) for r in request_ids if r in self.requests]

    def abort(self, request_ids) -> list[RequestOutput]:
        outputs = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is not None:
                outputs.append(self._finish(request, "abort"))
        return outputs

    def fail_all(self, error: str) -> list[RequestOutput]:
        """The pipeline broke: every request ends with `error` (their KV is gone with the epoch)."""
        outputs = [self._finish(r, "error", error=error) for r in list(self.requests.values())]
        self._finished_seq_ids.clear()
        return outputs

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    def stats(self) -> SchedulerStats:
        return SchedulerStats(len(self.running), len(self.waiting), self.kv.usage, self.kv.prefix_queries,
                              self.kv.prefix_hits, self.kv.num_blocks, self.num_preemptions)

    # -- one step -------------------------------------------------------------
    def schedule(self, max_seqs: int | None = None, run_ahead: bool = True) -> SchedulerOutput | None:
        """One step's micro-batch; max_seqs caps its sequences (a pipeline splits the running ones
        over its micro-batches so that every stage has work); run_ahead=False: no step ahead of a
        request's step in flight, even with async scheduling."""
        budget = _Budget(self.config.max_num_batched_tokens, max_seqs or self.config.max_num_seqs,
                         run_ahead and self.config.async_scheduling)
        made_room = self._make_room()
        preempted = self._schedule_running(budget)
        if not preempted:  # (a request preempted in this step does not come straight back)
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
            num_new = min(request.num_tokens + request.num_output_placeholders - request.num_computed_tokens,
                          budget.tokens)
            new_blocks = self.kv.allocate(request.request_id, request.num_computed_tokens + num_new)
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
                new_blocks = self.kv.allocate(request.request_id, request.num_computed_tokens + num_new)
            if new_blocks is None or request.status is not Status.RUNNING:
                continue
            self._add_chunk(budget, request, num_new, new_blocks)
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
            self.kv.find_cached_prefix(request.all_token_ids)
        num_cached = len(cached) * self.config.block_size
        return num_cached + min(request.num_tokens - num_cached, tokens), cached

    def _schedule_waiting(self, budget: _Budget) -> None:
        while (self.waiting and budget.tokens > 0 and len(self.running) < self.config.max_num_seqs
               and len(budget.chunks) < budget.seqs):
            request = self.waiting[0]
            num_tokens, cached = self._first_chunk(request, budget.tokens)
            num_cached = len(cached) * self.config.block_size
            num_new = num_tokens - num_cached
            new_blocks = self.kv.allocate(request.request_id, num_tokens, cached)
            if new_blocks is None:
                break
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
            budget.new_sequences.append(NewSequence(request.seq_id, list(request.prompt_token_ids), request.sampling,
                                                    list(request.output_token_ids)))
            self._add_chunk(budget, request, num_new, new_blocks)

    def _can_run_ahead(self, request: Request) -> bool:
        """Async scheduling: one step ahead of a request whose step in flight samples, unless that
        token is sure to be its last."""
        p = request.sampling
        return (request.in_flight == 1 and request.num_output_placeholders == 1
                and len(request.output_token_ids) + 1 < p.max_tokens
                and request.num_tokens + 1 < self.config.max_model_len)

    def _add_chunk(self, budget: _Budget, request: Request, num_new: int, new_blocks: list[int]) -> None:
        start = request.num_computed_tokens
        tokens = request.all_token_ids[start:start + num_new]
        if len(tokens) < num_new:  # the token sampled by the step in flight: the stage fills it in
            tokens.append(PLACEHOLDER)
        request.num_computed_tokens += num_new
        sample = request.num_computed_tokens == request.num_tokens + request.num_output_placeholders
        if sample:
            request.num_output_placeholders += 1
        budget.chunks.append(request.seq_id, tokens, start, new_blocks, sample)
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
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.recent_preemptions.append(request.request_id)
        self.policy.enqueue(self.waiting, request, preempted=True)

    def update_from_output(self, output: SchedulerOutput, sampled: list[SampledToken],
                           prompt_logprobs: list[PromptLogprobs] = ()) -> list[RequestOutput]:
        by_seq = {s.seq_id: s for s in sampled}
        scored = {p.seq_id: p for p in prompt_logprobs}
        results, bs, c = [], self.config.block_size, output.step_batch.chunks
        for request_id, seq_id, start, n, sample in zip(output.request_ids, c.seq_ids, c.start_positions,
                                                        c.num_tokens, c.sample):
            request = self.requests.get(request_id)
            if request is None or request.seq_id != seq_id:
                continue  # aborted or preempted meanwhile
            request.in_flight -= 1
            if (start + n) // bs > start // bs:  # the chunk filled a block: it may serve as a cached prefix
                # (only tokens whose ids are known: a step ahead may be computing the next one)
                self.kv.cache_full_blocks(request_id, request.all_token_ids,
                                          min(request.num_computed_tokens, request.num_tokens))
            scores = self._new_prompt_logprobs(request, scored.get(seq_id))
            if not sample:
                if scores is not None:
                    results.append(scores)
                continue
            request.num_output_placeholders -= 1
            token = by_seq.get(seq_id)
            if token is None:
                continue
            if token.error is not None:  # this request's row failed to sample: it ends alone
                results.append(self._finish(request, "error", error=token.error, own_fault=True))
                continue
            request.append_output(token.token_id)
            result = RequestOutput(request_id, [token.token_id], [token] if token.logprob is not None else [],
                                   num_prompt_tokens=len(request.prompt_token_ids),
                                   num_cached_tokens=request.num_cached_tokens)
            if scores is not None:
                result.prompt_logprobs, result.prompt_logprobs_start = scores.prompt_logprobs, \
                    scores.prompt_logprobs_start
            if len(request.output_token_ids) == 1 and request.first_scheduled_time is not None:
                result.queue_seconds = request.first_scheduled_time - request.arrival_time
            reason, stop_id = self._stop_reason(request, token.token_id)
            if reason is not None:
                self._finish(request, reason)
                result.finish_reason, result.stop_token_id = reason, stop_id
            results.append(result)
        return results

    @staticmethod
    def _new_prompt_logprobs(request: Request, scores: PromptLogprobs | None) -> RequestOutput | None:
        """The prompt logprobs a chunk brought that the request has not had yet (a preempted request's
        prompt is scored again when it is recomputed)."""
        if scores is None:
            return None
        skip = request.num_prompt_logprobs + 1 - scores.start  # positions 1.. delivered so far
        if skip < 0 or skip >= len(scores.entries):
            return None
        request.num_prompt_logprobs += len(scores.entries) - skip
        return RequestOutput(request.request_id, prompt_logprobs=scores.entries[skip:],
                             prompt_logprobs_start=scores.start + skip,
                             num_prompt_tokens=len(request.prompt_token_ids))

    def _stop_reason(self, request: Request, token_id: int) -> tuple[str | None, int | None]:
        p = request.sampling
        enough = len(request.output_token_ids) >= p.min_tokens
        if enough and not p.ignore_eos and token_id in self.config.eos_token_ids:
            return "stop", token_id
        if enough and token_id in p.stop_token_ids:
            return "stop", token_id
        if len(request.output_token_ids) >= p.max_tokens or request.num_tokens >= self.config.max_model_len:
            return "length", None
        return None, None

    def _finish(self, request: Request, reason: str, error: str | None = None, own_fault: bool = False
                ) -> RequestOutput:
        self.requests.pop(request.request_id, None)
        if request.status is Status.RUNNING:
            self.running.remove(request)
            self._finished_seq_ids.append(request.seq_id)
        elif request.status is Status.WAITING and request in self.waiting:
            self.waiting.remove(request)
        request.status = Status.FINISHED
        self.kv.free_request(request.request_id)
        return RequestOutput(request.request_id, finish_reason=reason, error=error, own_fault=own_fault,
                             num_prompt_tokens=len(request.prompt_token_ids),
                             num_cached_tokens=request.num_cached_tokens)


class QueueFull(StagemeshError):
    """The waiting queue is at --max-waiting-requests."""
