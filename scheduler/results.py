"""A step's results taken into a scheduler: sampled tokens appended one by one under the stop conditions
(speculative decoding's accepted drafts among them), prompt logprobs passed on, full blocks offered to the
prefix cache, a prefill_only request's KV held for a decode replica (scheduler.kv_transfer)."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from scheduler.block_manager import BlockManager
from scheduler.config import SchedulerConfig
from scheduler.pipeline import token_runs
from scheduler.request import HeldKV, Request, RequestOutput
from scheduler.speculation import Speculator
from stagemesh.core.step import PromptLogprobs, SampledToken, StepBatch


class Queues(Protocol):
    """What a step's results change of the scheduler (scheduler.scheduler.Scheduler): its requests, their
    blocks, the speculator's figures and proposals, and finish, which ends a request."""
    config: SchedulerConfig
    requests: dict[str, Request]
    kv: BlockManager
    spec: Speculator | None
    max_model_len: int

    def finish(self, request: Request, reason: str, error: str | None = None, own_fault: bool = False,
               kv_load_failed: bool = False, hold_kv: bool = False) -> RequestOutput: ...


def take_step(s: Queues, batch: StepBatch, request_ids: list[str], sampled: list[SampledToken],
              prompt_logprobs: Sequence[PromptLogprobs], drafts: dict[int, list[int]]) -> list[RequestOutput]:
    """Scheduler.update_from_output: each sampling chunk's tokens (1..N+1 for a chunk with N drafts, checked
    by scheduler.pipeline.check_result), prompt logprobs, and a draft model's proposals (`drafts`), for the
    step `batch` of these requests (in chunk order)."""
    by_seq = dict(token_runs(sampled))
    scored = {p.seq_id: p for p in prompt_logprobs}
    outputs: list[RequestOutput] = []
    c = batch.chunks
    for request_id, seq_id, start, n, sample, num_drafts in zip(request_ids, c.seq_ids, c.start_positions,
                                                                c.num_tokens, c.sample, c.draft_counts()):
        request = s.requests.get(request_id)
        if request is None or request.seq_id != seq_id:
            continue  # aborted or preempted meanwhile
        request.in_flight -= 1
        scores = request.new_prompt_logprobs(scored.get(seq_id))
        if not sample:
            _cache_blocks(s, request, start + n)
            if scores is not None:
                outputs.append(scores)
            continue
        request.num_output_placeholders -= 1
        tokens = by_seq.get(seq_id)
        if tokens is None:
            continue
        end = start + n - num_drafts + len(tokens) - 1  # past the accepted drafts
        result = _take_tokens(s, request, tokens, num_drafts, end, drafts.get(seq_id))
        if scores is not None:
            result.prompt_logprobs, result.prompt_logprobs_start = scores.prompt_logprobs, \
                scores.prompt_logprobs_start
        outputs.append(result)
    return outputs


def _take_tokens(s: Queues, request: Request, tokens: list[SampledToken], num_drafts: int, computed: int,
                 proposed: list[int] | None) -> RequestOutput:
    """Append a chunk's tokens one by one, each checked against the stop conditions (a stop inside an
    accepted run ends the request there); the rejected drafts' positions count as not computed (their
    KV slots are written again later)."""
    if num_drafts:
        accepted = len(tokens) - 1
        request.num_computed_tokens -= num_drafts - accepted
        assert s.spec is not None  # (drafts come from it)
        s.spec.record(num_drafts, accepted)
    first = not request.output_token_ids
    result = RequestOutput(request.request_id, num_prompt_tokens=len(request.prompt_token_ids),
                           num_cached_tokens=request.num_cached_tokens)
    if first and request.first_scheduled_time is not None:
        result.queue_seconds = request.first_scheduled_time - request.arrival_time
    for token in tokens:
        if token.error is not None:  # this request's row failed to sample: it ends alone
            failed = s.finish(request, "error", error=token.error, own_fault=True)
            failed.new_token_ids, failed.new_logprobs = result.new_token_ids, result.new_logprobs
            return failed
        request.append_output(token.token_id)
        result.new_token_ids.append(token.token_id)
        if token.pooled is not None:  # a pooling request: its one output (max_tokens 1) ends it
            result.pooled = token.pooled
        if token.logprob is not None:
            result.new_logprobs.append(token)
        reason, stop_id = request.stop_reason(token.token_id, s.config.eos_token_ids, s.max_model_len)
        if reason is None and request.prefill_only:  # the prompt is computed: its KV waits for a decode replica
            reason = "prefilled"
            result.held_kv = HeldKV(list(s.kv.tables.get(request.request_id, ())), len(request.prompt_token_ids))
        if reason is not None:
            _cache_blocks(s, request, computed)
            s.finish(request, reason)
            result.finish_reason, result.stop_token_id = reason, stop_id
            return result
    _cache_blocks(s, request, computed)
    if s.spec is not None:
        s.spec.propose(request, proposed)
    return result


def _cache_blocks(s: Queues, request: Request, computed: int) -> None:
    """Blocks full of tokens a step took in has computed (not those of a step ahead, in flight; not
    rejected drafts) may serve as a cached prefix."""
    s.kv.cache_full_blocks(request.request_id, request.all_token_ids, min(computed, request.num_tokens),
                           request.hash_root)
