"""Step assembly: the chunks of the requests a step runs, gathered under its token budget into a StepBatch.

A chunk is a request's next tokens from its num_computed_tokens: a prefill's slice of the prompt, a decode's
last token (with speculative decoding's drafts after it), or, run ahead (async scheduling), PLACEHOLDER for
the token its step in flight samples, which the first stage fills in. A newly admitted request's sequence
(its prompt and sampling parameters) goes to the stages once, in the step that admits it.

Asynchronous scheduling (vLLM's --async-scheduling): a request whose step in flight samples a token may be
scheduled once more before that token is back, as a decode of PLACEHOLDER (Request.num_output_placeholders
counts the tokens not yet known), which the first stage replaces with the token the last stage sampled for the
sequence in the step before (stages run steps in order; stage_worker.step_executor.RunAhead). So the next step
is on the stages before the current one ends, and the scheduler's work and both RPCs overlap the model. A
request that turns out to have finished (EOS, stop token) wastes the one token computed ahead; its result is
dropped.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from scheduler.policy import FairShare
from scheduler.request import Request
from scheduler.speculation import Speculator
from stagemesh.core.step import PLACEHOLDER, NewSequence, ScheduledChunks, StepBatch


@dataclass
class SchedulerOutput:
    step_batch: StepBatch
    request_ids: list[str]  # in chunk order
    num_preempted: int = 0


@dataclass
class StepBudget:
    """What a step being built may still take (tokens, sequences), and what it has taken."""
    tokens: int
    seqs: int
    run_ahead: bool = False  # may schedule a step ahead of a request's step in flight
    chunks: ScheduledChunks = field(default_factory=ScheduledChunks)
    new_sequences: list[NewSequence] = field(default_factory=list)
    request_ids: list[str] = field(default_factory=list)

    @property
    def full(self) -> bool:
        return self.tokens <= 0 or len(self.chunks) >= self.seqs

    def add_sequence(self, request: Request) -> None:
        """The stages' first sight of an admitted request (again after a preemption: a new seq_id)."""
        self.new_sequences.append(NewSequence(request.seq_id, list(request.prompt_token_ids), request.sampling,
                                              list(request.output_token_ids), request.lora_name))

    def add_chunk(self, request: Request, num_new: int, new_blocks: list[int], drafts: Sequence[int] = (),
                  fair: FairShare | None = None) -> None:
        """The request's next num_new tokens (drafts among them), its blocks' new ones, and whether the chunk
        samples; the request counts them computed (and a sampled token as a placeholder until it is back)."""
        start, known = request.num_computed_tokens, num_new - len(drafts)
        tokens = request.all_token_ids[start:start + known]
        if len(tokens) < known:  # the token sampled by the step in flight: the stage fills it in
            tokens.append(PLACEHOLDER)
        tokens += drafts
        request.num_computed_tokens += num_new
        sample = request.num_computed_tokens - len(drafts) == request.num_tokens + request.num_output_placeholders
        if sample:
            request.num_output_placeholders += 1
        if fair is not None:
            fair.served(request, num_new, sample)
        self.chunks.append(request.seq_id, tokens, start, new_blocks, sample, len(drafts))
        self.request_ids.append(request.request_id)
        self.tokens -= num_new

    def batch(self, step_id: int, finished_seq_ids: list[int]) -> StepBatch:
        return StepBatch(step_id, self.new_sequences, self.chunks, finished_seq_ids)


def can_run_ahead(request: Request, max_model_len: int) -> bool:
    """Async scheduling: one step ahead of a request whose step in flight samples, unless that token is sure to
    be its last."""
    return (request.in_flight == 1 and request.num_output_placeholders == 1
            and len(request.output_token_ids) + 1 < request.sampling.max_tokens
            and request.num_tokens + 1 < max_model_len)


def next_chunk(request: Request, budget_tokens: int, spec: Speculator | None) -> tuple[int, list[int]]:
    """A running request's next chunk: (its tokens, the drafts among them): what it has not computed, with its
    drafts on a decode (speculative decoding), cut to the step's budget (which may cut the drafts too)."""
    num_new = request.num_tokens + request.num_output_placeholders - request.num_computed_tokens
    decode = num_new == 1 and not request.num_output_placeholders
    drafts = spec.drafts(request) if spec is not None and decode else []
    num_new = min(num_new + len(drafts), budget_tokens)
    return num_new, drafts[:num_new - 1]
