"""Disaggregated prefill's KV under decode context parallelism (stage_worker.kv_transfer): what crosses the
wire is the canonical whole block [blocks, block_size, every KV head, head_dim]; a DCP stage's read reassembles
it from its ranks' shares (assemble_blocks) and its write keeps each rank's share (rank_share). Both against a
layout built by hand from stage_worker.context's and HeadShard's rules, for split and replicated KV heads and
DCP size 1 (the layout before DCP)."""
from __future__ import annotations

import pytest
import torch

from stagemesh.core.model_config import ModelConfig
from stage_worker.kv_transfer import assemble_blocks, rank_share
from stage_worker.parallel import HeadShard, TPGroup

BLOCK_SIZE, HEAD_DIM, BLOCKS = 8, 4, 3


def config(heads: int, kv_heads: int) -> ModelConfig:
    return ModelConfig(model_type="llama", hidden_size=heads * HEAD_DIM, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=HEAD_DIM, vocab_size=32,
                       rms_norm_eps=1e-6, rope_theta=10000.0, rope_scaling=None, max_position_embeddings=128,
                       tie_word_embeddings=False, attention_bias=False, qk_norm=False, eos_token_ids=(1,),
                       bos_token_id=None, torch_dtype="float32")


def hand_share(whole: torch.Tensor, cfg: ModelConfig, tp_size: int, dcp_size: int, rank: int) -> torch.Tensor:
    """Rank `rank`'s cache blocks, element by element: offsets [c * b, (c + 1) * b) of each block, its heads."""
    shard = HeadShard.for_rank(cfg, TPGroup(rank, tp_size, cp_size=dcp_size))
    b, c = BLOCK_SIZE // dcp_size, rank % dcp_size
    out = torch.empty(BLOCKS, b, shard.num_kv_heads, HEAD_DIM)
    for blk in range(BLOCKS):
        for t in range(b):
            for j in range(shard.num_kv_heads):
                out[blk, t, j] = whole[blk, c * b + t, shard.kv_start + j]
    return out


@pytest.mark.parametrize("tp_size,dcp_size,kv_heads", [
    (2, 2, 1), (4, 2, 2), (4, 2, 1), (8, 2, 2), (4, 4, 2), (8, 4, 1), (8, 8, 1),  # DCP: split and replicated heads
    (1, 1, 2), (2, 1, 2), (4, 1, 2), (8, 1, 1),  # DCP size 1: heads split or replicated, every token on each rank
])
def test_whole_blocks_reassemble_from_the_ranks_shares_and_split_back(tp_size, dcp_size, kv_heads):
    cfg = config(8, kv_heads)
    whole = torch.randn(BLOCKS, BLOCK_SIZE, kv_heads, HEAD_DIM)
    parts = [hand_share(whole, cfg, tp_size, dcp_size, r) for r in range(tp_size)]
    assert torch.equal(assemble_blocks(torch.stack(parts), dcp_size, kv_heads), whole)
    for r in range(tp_size):
        tp = TPGroup(r, tp_size, cp_size=dcp_size)
        shard = HeadShard.for_rank(cfg, tp)
        assert torch.equal(rank_share(whole, dcp_size, tp.cp_rank, shard.kv_start, shard.num_kv_heads), parts[r])


def test_the_shares_are_disjoint_in_tokens_within_a_group():
    """Within a DCP group the ranks' token offsets tile the block: a value written at one offset lands on one rank."""
    cfg = config(8, 1)
    whole = torch.arange(BLOCKS * BLOCK_SIZE, dtype=torch.float32).view(BLOCKS, BLOCK_SIZE, 1, 1).expand(
        BLOCKS, BLOCK_SIZE, 1, HEAD_DIM).contiguous()
    seen = torch.cat([hand_share(whole, cfg, 4, 4, r)[:, :, 0, 0] for r in range(4)], dim=1)
    assert torch.equal(seen, whole[:, :, 0, 0])
