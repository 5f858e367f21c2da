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

import torch


def held_count(lengths: torch.Tensor, block_size: int, dcp_size: int, dcp_rank: int) -> torch.Tensor:
    """How many of positions [0, n) rank `dcp_rank` holds, for each n in `lengths` (any integer tensor)."""
    b = block_size // dcp_size
    return (lengths // block_size) * b + (lengths % block_size - dcp_rank * b).clamp(0, b)


def dcp_metadata(positions: torch.Tensor, row_seqs: torch.Tensor, block_tables: torch.Tensor, block_size: int,
                 dcp_size: int, dcp_rank: int):
    """This rank's stage_worker.model.DCPMetadata of a step: `positions` [tokens] int64 and `row_seqs` [tokens]
    (each token's sequence, an index into `block_tables` [seqs, max_blocks] int32)."""
    from stage_worker.model import DCPMetadata

    b = block_size // dcp_size
    offset = positions % block_size
    held = ((offset // b) == dcp_rank).nonzero().squeeze(1)
    row_tables = block_tables.index_select(0, row_seqs)
    blocks = row_tables.gather(1, (positions // block_size)[:, None]).squeeze(1).long()
    slots = (blocks * b + offset % b).index_select(0, held)
    visible = held_count(positions + 1, block_size, dcp_size, dcp_rank).to(torch.int32)
    starts = torch.arange(positions.shape[0] + 1, dtype=torch.int32, device=positions.device)
    return DCPMetadata(held, slots, row_tables, visible, starts)
