"""A pipeline step as the scheduler sends it to every stage: plain dataclasses, no protobuf.

The scheduler sends a sequence's prompt and sampling parameters once
(NewSequence), then per step only the chunk of new tokens and any newly
allocated KV blocks (ScheduledChunk): vLLM v1's NewRequestData /
CachedRequestData idea. A preempted sequence is freed and later sent again
as new, with the tokens it had generated in output_token_ids.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from stagemesh.sampling_params import SamplingParams


@dataclass
class NewSequence:
    seq_id: int
    prompt_token_ids: list[int]
    sampling: SamplingParams
    # tokens generated before a preemption; they count for penalties and seeds
    output_token_ids: list[int] = field(default_factory=list)


@dataclass
class ScheduledChunk:
    seq_id: int
    # the tokens whose KV this step computes (prompt chunk, or the last sampled token)
    token_ids: list[int]
    # position of token_ids[0] == the sequence's num_computed_tokens before this step
    start_position: int
    # KV block ids appended to this sequence's block table in this step
    new_block_ids: list[int]
    # sample a token after this chunk (the prompt is complete / decoding)
    sample: bool


@dataclass
class StepBatch:
    step_id: int
    micro_batch: int
    new_sequences: list[NewSequence] = field(default_factory=list)
    chunks: list[ScheduledChunk] = field(default_factory=list)
    # sequences whose state (block table, history) the stage must drop
    finished_seq_ids: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)


@dataclass
class SampledToken:
    seq_id: int
    token_id: int
    logprob: float | None = None
    top_token_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)
