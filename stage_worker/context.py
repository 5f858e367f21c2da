"""Decode context parallelism (vLLM's `--decode-context-parallel-size`): where a DCP rank keeps a sequence's KV.

The scheduler's blocks hold `block_size` tokens, whatever a stage's DCP size D. On a stage with D > 1 each
block's tokens are split in D pieces of `block_size / D` (its `kv_block_size`): rank c of a DCP group keeps
offsets [c * b, (c + 1) * b) of every block, in its own cache's block of the same id. So the ranks share a
sequence's tokens evenly (decode appends move to the next rank every b tokens), the scheduler's block tables
serve every rank unchanged (a block's id names the block on each rank; the position names the rank that
holds it), and a rank's cache holds D times the blocks a whole-block layout would in the same memory.

A rank's held positions of a sequence, in order, are its "local" positions: local index i lies in the
sequence's block table[i // b], at offset i % b, of the rank's cache, which is what the paged-attention
kernels read when they are given that block table and a count of positions.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from stagemesh.core.errors import StagemeshError
from stagemesh.core.model_config import ModelConfig


@dataclass
class CPMetadata:
    """A context-parallel rank's view of the step (dcp_metadata, TokenSplit.metadata below): which
    of the step's tokens' KV it keeps and where, and, per query row, how many of its sequence's kept positions the
    row sees."""

    held: torch.Tensor  # [held tokens] int64: the step's tokens whose K and V this rank keeps
    slot_mapping: torch.Tensor  # [held tokens] int64: their slots in this rank's cache
    row_seqs: torch.Tensor  # [rows] int32: each query row's sequence (a row of AttentionMetadata.block_tables)
    row_visible: torch.Tensor  # [rows] int32: the kept positions each row sees (those <= its own)
    # prefill context parallelism (TokenSplit below): this rank computes its share of the tokens,
    # and the rows above are every rank's, each rank's padded to this many; 0: decode context parallelism (each
    # rank computes every token, its share of the heads)
    pad: int = 0


def held_count(lengths: torch.Tensor, block_size: int, dcp_size: int, dcp_rank: int) -> torch.Tensor:
    """How many of positions [0, n) rank `dcp_rank` holds, for each n in `lengths` (any integer tensor)."""
    b = block_size // dcp_size
    return (lengths // block_size) * b + (lengths % block_size - dcp_rank * b).clamp(0, b)


def dcp_metadata(positions: torch.Tensor, row_seqs: torch.Tensor, block_tables: torch.Tensor, block_size: int,
                 dcp_size: int, dcp_rank: int) -> CPMetadata:
    """This rank's CPMetadata of a step: `positions` [tokens] int64 and `row_seqs` [tokens]
    (each token's sequence, an index into `block_tables` [seqs, max_blocks] int32)."""
    b = block_size // dcp_size
    offset = positions % block_size
    held = ((offset // b) == dcp_rank).nonzero().squeeze(1)
    blocks = block_tables[row_seqs, positions // block_size].long()
    slots = (blocks * b + offset % b).index_select(0, held)
    visible = held_count(positions + 1, block_size, dcp_size, dcp_rank).to(torch.int32)
    return CPMetadata(held, slots, row_seqs.to(torch.int32), visible)


class TokenSplit:
    """Prefill context parallelism's split of a step (vLLM's PCP, stage_worker.model.Attention): each rank of the
    group computes the step's tokens whose KV it keeps (the layout above, so no KV moves after it is computed),
    through every layer, with its TP shard of the weights. A rank's tokens are interleaved with the others' every b
    positions (striped: the causal mask's work is even over the ranks, as zig-zag chunks make it for
    contiguous ones). Each rank runs `pad` rows, the most any rank has: its tokens, then padding rows (position 0,
    token 0, hidden zeros), which keep no KV, see no key and are dropped when the rows are gathered, rank by
    rank (so no rank runs a layer on no rows)."""

    def __init__(self, positions: torch.Tensor, block_size: int, size: int, rank: int):
        b = block_size // size
        owner = (positions % block_size) // b
        counts = torch.bincount(owner, minlength=size)
        self.size, self.rank, self.pad = size, rank, int(counts.max())
        order = torch.sort(owner, stable=True).indices  # the step's tokens, rank by rank
        firsts = torch.cumsum(counts, 0) - counts
        place = torch.arange(len(order), device=positions.device) - firsts[owner[order]]
        self.gathered = torch.full((size, self.pad), -1, dtype=torch.long, device=positions.device)
        self.gathered[owner[order], place] = order  # each rank's row r: the step's token (-1: padding)
        self.mine = self.gathered[rank, :int(counts[rank])]  # this rank's tokens, in step order
        self.padding = self.gathered[rank] < 0
        flat = self.gathered.view(-1)
        self.valid = flat >= 0
        self.tokens = flat[self.valid]

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's `pad` rows of x [step tokens, ...]: its tokens', then zeros."""
        out = x.index_select(0, self.gathered[self.rank].clamp(min=0))
        return out.masked_fill_(self.padding.view(-1, *[1] * (x.dim() - 1)), 0)

    def gather(self, x: torch.Tensor, group) -> torch.Tensor:
        """Every rank's `pad` rows of x back to [step tokens, ...] in step order, on every rank."""
        parts = group.cp_gather(x).view(self.size * self.pad, *x.shape[1:])
        out = torch.empty((len(self.tokens), *x.shape[1:]), dtype=x.dtype, device=x.device)
        out[self.tokens] = parts[self.valid]
        return out

    def metadata(self, positions: torch.Tensor, row_seqs: torch.Tensor, block_tables: torch.Tensor, block_size: int,
                 rank: int) -> CPMetadata:
        """This rank's CPMetadata: the slots of its tokens, and every gathered row's view of
        the positions this rank keeps (a padding row sees none)."""
        b = block_size // self.size
        mine = self.mine
        blocks = block_tables[row_seqs[mine], positions[mine] // block_size].long()
        slots = blocks * b + positions[mine] % block_size % b
        flat = self.gathered.view(-1).clamp(min=0)
        visible = held_count(positions[flat] + 1, block_size, self.size, rank).masked_fill(~self.valid, 0)
        held = torch.arange(len(mine), device=positions.device)
        return CPMetadata(held, slots, row_seqs[flat].to(torch.int32), visible.to(torch.int32), self.pad)


def check_context_parallel(cfg: ModelConfig, tp_size: int, dcp_size: int, pcp_size: int, block_size: int,
                           expert_parallel: bool, lora: bool) -> None:
    """The sizes' own checks (stagemesh.core.model_config), and what context parallelism does not run with yet."""
    cfg.check_decode_context_parallel(tp_size, dcp_size, block_size)
    cfg.check_prefill_context_parallel(pcp_size, block_size, dcp_size)
    flag = "--decode-context-parallel-size" if dcp_size > 1 else "--prefill-context-parallel-size"
    if max(dcp_size, pcp_size) > 1 and expert_parallel:
        raise StagemeshError(f"{flag} with --enable-expert-parallel is not built yet")
    if pcp_size > 1 and lora:
        raise StagemeshError(f"{flag} with --enable-lora is not built yet")


def share_step(meta, input_ids: torch.Tensor | None, num_tokens: list[int], block_size: int,
               tp) -> torch.Tensor | None:
    """This rank's share of a step, set in `meta` (stage_worker.model.AttentionMetadata: its `cp`, and with PCP its
    `split` and this rank's rows of the positions); returns this rank's rows of `input_ids` (PCP) or them all."""
    row_seqs = torch.repeat_interleave(torch.arange(len(num_tokens), device=meta.positions.device),
                                       torch.tensor(num_tokens, device=meta.positions.device))
    if not tp.pcp:
        meta.cp = dcp_metadata(meta.positions, row_seqs, meta.block_tables, block_size, tp.cp_size, tp.cp_rank)
        return input_ids
    meta.split = split = TokenSplit(meta.positions, block_size, tp.cp_size, tp.cp_rank)
    meta.cp = split.metadata(meta.positions, row_seqs, meta.block_tables, block_size, tp.cp_rank)
    meta.positions = split.rows(meta.positions)
    return None if input_ids is None else split.rows(input_ids)
