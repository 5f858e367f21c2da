"""A pipeline step as the scheduler sends it to every stage: plain Python, no protobuf.

The scheduler sends a sequence's prompt and sampling parameters once
(NewSequence), then per step only the chunk of new tokens and any newly
allocated KV blocks (ScheduledChunk): vLLM v1's NewRequestData /
CachedRequestData idea. A preempted sequence is freed and later sent again
as new, with the tokens it had generated in output_token_ids.

A step's chunks are kept as columns (ScheduledChunks), the shape they have
on the wire, so that neither end loops over them in Python to convert.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Iterator

from stagemesh.core.errors import StagemeshError
from stagemesh.core.sampling_params import SamplingParams

# A token id in a step that stands for the token its sequence sampled in the previous step, which
# was still in flight when this one was scheduled (async scheduling); the first stage fills it in.
PLACEHOLDER = -1


@dataclass
class NewSequence:
    seq_id: int
    prompt_token_ids: list[int]
    sampling: SamplingParams
    # tokens generated before a preemption; they count for penalties and seeds
    output_token_ids: list[int] = field(default_factory=list)
    lora_name: str = ""  # the LoRA adapter it runs with ("": the base model)


@dataclass
class ScheduledChunk:
    """One sequence's part of a step; a view of one row of ScheduledChunks."""
    seq_id: int
    # the tokens whose KV this step computes (prompt chunk, or the last sampled token)
    token_ids: list[int]
    # position of token_ids[0] == the sequence's num_computed_tokens before this step
    start_position: int
    # KV block ids appended to this sequence's block table in this step
    new_block_ids: list[int]
    # sample a token after this chunk (the prompt is complete / decoding)
    sample: bool
    # speculative decoding: how many of token_ids' last tokens are drafts, which the last stage verifies
    num_draft_tokens: int = 0


@dataclass
class ScheduledChunks:
    """A step's chunks as parallel columns: chunk i is seq_ids[i], num_tokens[i] tokens of token_ids (back
    to back), start_positions[i], num_new_blocks[i] block ids of new_block_ids (back to back), sample[i],
    and num_draft_tokens[i] drafts at the end of its tokens (the column is empty when no chunk has any)."""
    seq_ids: list[int] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    start_positions: list[int] = field(default_factory=list)
    num_new_blocks: list[int] = field(default_factory=list)
    new_block_ids: list[int] = field(default_factory=list)
    sample: list[bool] = field(default_factory=list)
    num_draft_tokens: list[int] = field(default_factory=list)

    @classmethod
    def of(cls, chunks: Iterable[ScheduledChunk]) -> ScheduledChunks:
        columns = cls()
        for c in chunks:
            columns.append(c.seq_id, c.token_ids, c.start_position, c.new_block_ids, c.sample, c.num_draft_tokens)
        return columns

    def append(self, seq_id: int, token_ids: list[int], start_position: int, new_block_ids: list[int],
               sample: bool, num_draft_tokens: int = 0) -> None:
        if num_draft_tokens or self.num_draft_tokens:  # the column stays empty until a chunk has drafts
            self.num_draft_tokens = self.draft_counts() + [num_draft_tokens]
        self.seq_ids.append(seq_id)
        self.num_tokens.append(len(token_ids))
        self.token_ids += token_ids
        self.start_positions.append(start_position)
        self.num_new_blocks.append(len(new_block_ids))
        self.new_block_ids += new_block_ids
        self.sample.append(sample)

    def __len__(self) -> int:
        return len(self.seq_ids)

    def draft_counts(self) -> list[int]:
        """num_draft_tokens of every chunk (zeros when the step carries no drafts)."""
        return self.num_draft_tokens or [0] * len(self.seq_ids)

    def placeholders(self) -> list[tuple[int, int]]:
        """(index in token_ids, seq_id) of each chunk that ends in PLACEHOLDER (async scheduling)."""
        found, at = [], 0
        for seq_id, n in zip(self.seq_ids, self.num_tokens):
            at += n
            if self.token_ids[at - 1] == PLACEHOLDER:
                found.append((at - 1, seq_id))
        return found

    def has_placeholders(self) -> bool:
        return PLACEHOLDER in self.token_ids

    def fill_placeholders(self, tokens: list[int]) -> None:
        """Put `tokens` where the chunks end in PLACEHOLDER, in order (the first stage, and its TP followers)."""
        found = self.placeholders()
        if len(found) != len(tokens):
            raise StagemeshError(f"{len(found)} tokens are scheduled ahead in the step, {len(tokens)} came to fill "
                                 "them")
        for (index, _), token in zip(found, tokens):
            self.token_ids[index] = token

    def __iter__(self) -> Iterator[ScheduledChunk]:
        tok = blk = 0
        for seq_id, n, start, b, sample, d in zip(self.seq_ids, self.num_tokens, self.start_positions,
                                                  self.num_new_blocks, self.sample, self.draft_counts()):
            yield ScheduledChunk(seq_id, self.token_ids[tok:tok + n], start, self.new_block_ids[blk:blk + b], sample,
                                 d)
            tok, blk = tok + n, blk + b

    def __getitem__(self, index: int) -> ScheduledChunk:
        return list(self)[index]


@dataclass
class StepBatch:
    step_id: int
    new_sequences: list[NewSequence] = field(default_factory=list)
    # a list of ScheduledChunk is taken too (tests and benchmarks build steps chunk by chunk)
    chunks: ScheduledChunks = field(default_factory=ScheduledChunks)
    # sequences whose state (block table, history) the stage must drop
    finished_seq_ids: list[int] = field(default_factory=list)
    # a warm-up step before the replica serves (scheduler.warmup): computed as any other, counted in no load
    # statistic (the experts' token counts EPLB reads, the stage's step and token counters)
    warmup: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.chunks, ScheduledChunks):
            self.chunks = ScheduledChunks.of(self.chunks)

    @property
    def num_tokens(self) -> int:
        return len(self.chunks.token_ids)


@dataclass(frozen=True)
class EpochSpec:
    """What a stage needs to join a pipeline epoch (the scheduler's JoinPipeline)."""
    epoch: int
    store_host: str  # the torch.distributed store the scheduler hosts
    store_port: int
    world_size: int
    rank_offset: int  # global rank of the stage's TP rank 0
    tp_sizes: tuple[int, ...]  # every stage's TP size, in stage order
    num_kv_blocks: int
    max_model_len: int
    max_num_batched_tokens: int
    next_stage_address: str = ""  # grpc handoff: the next stage's, empty on the last
    first_stage_address: str = ""  # grpc handoff: the first stage's, on the last stage of several
    num_host_kv_blocks: int = 0  # slots of the stage's host KV tier (docs/kv-tiers.md); 0: none
    kv_read_key: bytes = b""  # disaggregated prefill: the key of its scheduler's read tickets (core.kv_ticket)


@dataclass(frozen=True)
class StepStats:
    """What a stage measured of one step."""
    compute_seconds: float = 0.0
    handoff_wait_seconds: float = 0.0
    handoff_bytes: int = 0


@dataclass(slots=True)
class TokenLogprob:
    """A token's log-probability given the tokens before it, its rank (1: most likely), the top N."""
    token_id: int
    logprob: float
    rank: int = 0
    top_token_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)


@dataclass(slots=True)
class PromptLogprobs:
    """The logprobs of one sequence's prompt tokens start, start + 1, ... computed by one step."""
    seq_id: int
    start: int
    entries: list[TokenLogprob]


@dataclass(slots=True)
class SampledToken:
    seq_id: int
    token_id: int
    logprob: float | None = None
    top_token_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)
    # set when this sequence's row could not be sampled: its request fails alone (token_id is meaningless)
    error: str | None = None
