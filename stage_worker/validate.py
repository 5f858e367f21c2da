"""Checks of what a stage is sent, before any of it reaches its state or a kernel.

A stage trusts no caller: positions and lengths are checked against the epoch's
max_model_len, block ids against the KV cache, token ids against the vocabulary,
activations against the hidden size and the step. These checks need only the message
and the epoch's limits, so they run when the RPC arrives (a refused step costs the
pipeline nothing); the checks that need the sequences' state (which ids are known,
where each one's tokens continue) run just before the step (check_state).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from stagemesh.core.errors import StagemeshError
from stagemesh.core.lora import LoRAError
from stagemesh.core.sampling_params import INT32_MAX, check_token_ids
from stagemesh.core.speculative import MAX_NUM_SPECULATIVE_TOKENS
from stagemesh.core.step import PLACEHOLDER, StepBatch
from stagemesh.v1 import common_pb2

if TYPE_CHECKING:
    from stage_worker.runner import StageRunner


class InvalidStep(StagemeshError):
    """A Forward or PushActivations message that breaks the rules (INVALID_ARGUMENT)."""


@dataclass(frozen=True)
class StepLimits:
    """What an epoch allows (from JoinPipeline and the model); before any join, nothing is allowed."""
    vocab_size: int
    hidden_size: int
    block_size: int
    num_kv_blocks: int = 0
    max_model_len: int = 0
    max_num_batched_tokens: int = 0
    num_kv_groups: int = 1  # the model's KV cache groups (stagemesh.core.kv_groups): a chunk's blocks are per group

    @property
    def max_blocks_per_seq(self) -> int:
        """The blocks a sequence's tables hold at most (every group's)."""
        return -(-self.max_model_len // self.block_size) * self.num_kv_groups


def check_step(batch: StepBatch, limits: StepLimits) -> None:
    """Everything about a step that can be judged without the sequences' state."""
    c = batch.chunks
    n = len(c.seq_ids)
    if not limits.num_kv_blocks:
        raise InvalidStep("the stage has not joined a pipeline")
    _require(len(c.num_tokens) == len(c.start_positions) == len(c.num_new_blocks) == len(c.sample) == n,
             "the step's chunk columns differ in length")
    _require(len(set(c.seq_ids)) == n, "a sequence appears twice in the step")
    _require(not c.num_tokens or min(c.num_tokens) >= 1, "a chunk has no token")
    _require(sum(c.num_tokens) == len(c.token_ids), "num_tokens does not add up to the token ids sent")
    _require(len(c.token_ids) <= limits.max_num_batched_tokens,
             f"the step has {len(c.token_ids)} tokens; the pipeline allows {limits.max_num_batched_tokens}")
    _require(not c.num_new_blocks or min(c.num_new_blocks) >= 0, "a chunk appends a negative number of blocks")
    _require(sum(c.num_new_blocks) == len(c.new_block_ids), "num_new_blocks does not add up to the block ids sent")
    _require(not c.new_block_ids or (min(c.new_block_ids) >= 0 and max(c.new_block_ids) < limits.num_kv_blocks),
             f"a block id is outside the KV cache of {limits.num_kv_blocks} blocks")
    _require(not c.num_new_blocks or max(c.num_new_blocks) <= limits.max_blocks_per_seq,
             f"a chunk appends more blocks than a sequence of {limits.max_model_len} tokens holds")
    for start, count in zip(c.start_positions, c.num_tokens):
        _require(0 <= start and start + count <= limits.max_model_len,
                 f"positions {start}..{start + count - 1} are outside [0, {limits.max_model_len})")
    _check_tokens(batch, limits.vocab_size)
    _check_drafts(batch)
    for seq in batch.new_sequences:
        _require(0 < len(seq.prompt_token_ids) + len(seq.output_token_ids) <= limits.max_model_len,
                 f"new sequence {seq.seq_id} has no tokens or more than max_model_len {limits.max_model_len}")
        check_token_ids("prompt_token_ids", seq.prompt_token_ids, limits.vocab_size)
        check_token_ids("output_token_ids", seq.output_token_ids, limits.vocab_size)
        seq.sampling.check_vocab(limits.vocab_size)


def _check_tokens(batch: StepBatch, vocab_size: int) -> None:
    """Token ids in the vocabulary; PLACEHOLDER only as a chunk's last token (a step scheduled ahead)."""
    ids = batch.chunks.token_ids
    if not ids:
        return
    low, high = min(ids), max(ids)
    if high >= vocab_size or low < PLACEHOLDER:
        raise InvalidStep(f"token id {high if high >= vocab_size else low} is outside the vocabulary of {vocab_size}")
    if low == PLACEHOLDER:
        ends = {index for index, _ in batch.chunks.placeholders()}
        _require(ids.count(PLACEHOLDER) == len(ends), "a placeholder token stands elsewhere than a chunk's end")


def _check_drafts(batch: StepBatch) -> None:
    """Draft tokens (speculative decoding): at most MAX_NUM_SPECULATIVE_TOKENS per chunk, after at least one
    token that is not a draft, only in a chunk that samples, never beside a step run ahead."""
    c = batch.chunks
    if not c.num_draft_tokens:
        return
    _require(len(c.num_draft_tokens) == len(c.seq_ids), "the step's chunk columns differ in length")
    for n, d, sample in zip(c.num_tokens, c.num_draft_tokens, c.sample):
        _require(0 <= d <= MAX_NUM_SPECULATIVE_TOKENS and d < n and (sample or not d),
                 f"a chunk of {n} tokens carries {d} draft tokens (0 to {MAX_NUM_SPECULATIVE_TOKENS}, fewer than "
                 "its tokens, only where it samples)")
    _require(PLACEHOLDER not in c.token_ids, "a step carries both draft tokens and tokens scheduled ahead")


ACTIVATION_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}  # stages may compute in different dtypes


def check_activations(msg: common_pb2.Tensor, limits: StepLimits) -> int:
    """PushActivations' tensor: [tokens, hidden] of a float dtype, bytes that match; returns tokens."""
    shape = list(msg.shape)
    _require(msg.dtype in ACTIVATION_ITEMSIZE,
             f"activations of dtype {msg.dtype!r}; they travel as {', '.join(ACTIVATION_ITEMSIZE)}")
    _require(len(shape) == 2 and shape[1] == limits.hidden_size,
             f"activations of shape {shape}; this model's are [tokens, {limits.hidden_size}]")
    _require(1 <= shape[0] <= max(limits.max_num_batched_tokens, 1),
             f"activations of {shape[0]} tokens; a step has 1 to {limits.max_num_batched_tokens}")
    itemsize = ACTIVATION_ITEMSIZE[msg.dtype]
    _require(len(msg.data) == shape[0] * shape[1] * itemsize,
             f"activations of shape {shape} {msg.dtype} need {shape[0] * shape[1] * itemsize} bytes, "
             f"got {len(msg.data)}")
    return shape[0]


def check_tokens(tokens, limits: StepLimits) -> None:
    """Sampled tokens for a step run ahead: one per sequence of a step at most, each in the vocabulary."""
    _require(1 <= len(tokens) <= max(limits.max_num_batched_tokens, 1),
             f"{len(tokens)} sampled tokens; a step has 1 to {limits.max_num_batched_tokens} sequences")
    _require(0 <= min(tokens) and max(tokens) < limits.vocab_size,
             f"sampled tokens outside the vocabulary of {limits.vocab_size}")


def check_state(runner: StageRunner, batch: StepBatch, max_model_len: int) -> None:
    """The checks of a step that need the sequences' state, which `runner` keeps (just before the step): new ids
    are new, every other id is known, each chunk continues its sequence where its tokens end (or over
    the drafts of its last chunk, some of which were rejected) and its blocks cover it. Raises
    InvalidStep and changes nothing."""
    finished, new = set(batch.finished_seq_ids), {s.seq_id for s in batch.new_sequences}
    if len(new) != len(batch.new_sequences) or any(s in runner.block_tables and s not in finished for s in new):
        raise InvalidStep("a new sequence's id is already in use")
    if not new <= set(batch.chunks.seq_ids):
        raise InvalidStep("a new sequence comes without a chunk")
    _check_adapters(runner, batch, finished)
    c, bs, lens, tables = batch.chunks, runner.block_size, runner.seq_lens, runner.block_tables
    max_blocks, groups = -(-max_model_len // bs), len(runner.group_tables) + 1
    for seq_id, n, start, added in zip(c.seq_ids, c.num_tokens, c.start_positions, c.num_new_blocks):
        if added % groups:
            raise InvalidStep(f"sequence {seq_id} is sent {added} blocks for {groups} KV cache groups")
        added //= groups  # (each group's table grows as the first's)
        if seq_id in new:
            blocks = added  # a prefix-cache hit starts past the cached blocks it is sent
            if start > blocks * bs:
                raise InvalidStep(f"new sequence {seq_id} starts at {start} with {blocks} KV blocks")
        elif seq_id in lens and seq_id not in finished:
            blocks = len(tables[seq_id]) + added
            if not lens[seq_id] - runner.num_drafts.get(seq_id, 0) <= start <= lens[seq_id]:
                raise InvalidStep(f"sequence {seq_id} continues at position {start}; its tokens end at "
                                  f"{lens[seq_id]}")
        else:
            raise InvalidStep(f"sequence {seq_id} is not known to this stage")
        if blocks * bs < start + n:
            raise InvalidStep(f"sequence {seq_id} has {blocks} KV blocks for {start + n} tokens")
        if blocks > max_blocks:
            raise InvalidStep(f"sequence {seq_id} would hold {blocks} KV blocks; {max_blocks} hold max_model_len")


def _check_adapters(runner: StageRunner, batch: StepBatch, finished: set[int]) -> None:
    """The step's adapters are ones this stage serves, no more of them than --max-loras."""
    named = {s.seq_id: s.lora_name for s in batch.new_sequences if s.lora_name}
    if named and runner.lora is None:
        raise InvalidStep(f"sequence {next(iter(named))} asks for LoRA adapter {next(iter(named.values()))!r}; "
                          f"this stage runs without --enable-lora")
    if runner.lora is None:
        return
    names = {named.get(s) or ("" if s in finished else runner.seq_adapters.get(s, "")) for s in batch.chunks.seq_ids}
    names.discard("")
    try:
        runner.lora.check(names)
    except LoRAError as err:
        raise InvalidStep(str(err)) from None


def check_join(req, stage_index: int, tp_size: int, num_kv_blocks: int, model_positions: int, last: bool,
               needs_next_address: bool) -> None:
    """A JoinPipeline against what the stage knows of itself: its index and TP size in the world's layout,
    no more KV blocks than it offered, limits the model can take."""
    sizes = list(req.tp_sizes)
    _require(0 <= stage_index < len(sizes) <= 4096 and all(1 <= n <= 4096 for n in sizes),
             f"tp_sizes {sizes[:16]} do not give stage {stage_index} a place")
    _require(sizes[stage_index] == tp_size, f"tp_sizes gives stage {stage_index} TP={sizes[stage_index]}; it has "
                                            f"TP={tp_size}")
    _require(req.world_size == sum(sizes) and req.rank_offset == sum(sizes[:stage_index]),
             "world_size and rank_offset do not match tp_sizes")
    _require(0 < req.num_kv_blocks <= num_kv_blocks,
             f"num_kv_blocks {req.num_kv_blocks}: this stage holds 1 to {num_kv_blocks}")
    _require(0 < req.max_model_len <= model_positions,
             f"max_model_len {req.max_model_len} is outside the model's {model_positions} positions")
    _require(0 < req.max_num_batched_tokens <= INT32_MAX, "max_num_batched_tokens must be positive")
    _require(bool(req.store_host) and 0 < req.store_port < 65536, "the store's host and port are required")
    _require(req.epoch >= 0, "epoch must be >= 0")
    _require(last == (stage_index == len(sizes) - 1), f"stage {stage_index} is {'' if last else 'not '}the last "
                                                      f"stage of its model, unlike in this pipeline of {len(sizes)}")
    _require(not needs_next_address or bool(req.next_stage_address), "the next stage's address is required")
    _require(not req.first_stage_address or (last and stage_index > 0),
             "only the last stage of several takes the first stage's address")


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise InvalidStep(message)
