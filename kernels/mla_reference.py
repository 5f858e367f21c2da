"""Torch reference of multi-head latent attention's kernels (DeepSeek's MLA, stage_worker.mla): the CPU path and
the oracle of kernels.triton_mla.

A layer's cache holds each token's latent, cat(c_kv [kv_lora_rank], k_pe [qk_rope_head_dim]), its first half in
k_cache and its second in v_cache, each [blocks, block_size, 1, latent / 2] (stagemesh.core.families.deepseek_v2).
Absorbed attention scores a query q = cat(q_nope W_UK, q_pe) [heads, latent] against the latent itself, with every
head sharing it, and returns the attention-weighted c_kv [heads, kv_lora_rank]; W_UV is applied after.
"""
from __future__ import annotations

import torch

from kernels.reference import _finite


def write_latent(latent: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    """Write this step's latents [tokens, latent] into their slots, in place."""
    half = k_cache.shape[-1]
    k_cache.view(-1, half).index_copy_(0, slot_mapping, latent[:, :half].to(k_cache.dtype))
    v_cache.view(-1, half).index_copy_(0, slot_mapping, latent[:, half:].to(v_cache.dtype))


def latent_rows(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The latents of the given slots (any int shape), [*slots.shape, latent]."""
    half = k_cache.shape[-1]
    flat = slots.reshape(-1)
    rows = torch.cat([k_cache.view(-1, half).index_select(0, flat), v_cache.view(-1, half).index_select(0, flat)], -1)
    return rows.view(*slots.shape, 2 * half)


def gather_latent(k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                  length: int) -> torch.Tensor:
    """A sequence's first `length` latents, [length, latent]."""
    block_size = k_cache.shape[1]
    pos = torch.arange(length, device=k_cache.device)
    return latent_rows(k_cache, v_cache, block_table[pos // block_size].long() * block_size + pos % block_size)


def mla_attention_rows(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                       row_seqs: torch.Tensor, row_visible: torch.Tensor, scale: float,
                       kv_lora_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed attention of each query row t, q [rows, heads, latent], over the first row_visible[t] latents of
    sequence row_seqs[t] (a row of block_tables): the weighted c_kv [rows, heads, kv_lora_rank] in q's dtype and
    the lse of the scaled scores [rows, heads] fp32, in fp32 arithmetic. A row that sees nothing gives 0 and -inf
    (kernels.merge_attention_states ignores it). Decode rows (each its own sequence) run as one batch; runs of
    rows of one sequence (a prefill chunk, drafts) gather its latents once."""
    seqs = row_seqs.tolist()
    runs: list[list[int]] = []  # [first row, end row) of each run of one sequence
    for i, s in enumerate(seqs):
        if runs and seqs[runs[-1][0]] == s:
            runs[-1][1] = i + 1
        else:
            runs.append([i, i + 1])
    if len(runs) == len(seqs):
        tables = block_tables.index_select(0, row_seqs.long())
        return _attend(q, k_cache, v_cache, tables, row_visible, scale, kv_lora_rank)
    out = q.new_zeros(*q.shape[:2], kv_lora_rank)
    lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float32, device=q.device)
    for a, b in runs:
        table = block_tables[seqs[a]][None].expand(b - a, -1)
        out[a:b], lse[a:b] = _attend(q[a:b], k_cache, v_cache, table, row_visible[a:b], scale, kv_lora_rank,
                                     shared=True)
    return out, lse


def _attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
            visible: torch.Tensor, scale: float, kv_lora_rank: int,
            shared: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows with a block table each (`shared`: one table, gathered once for every row)."""
    rows, heads, _ = q.shape
    length = int(visible.max()) if rows else 0
    if length == 0:
        return (q.new_zeros(rows, heads, kv_lora_rank),
                torch.full((rows, heads), float("-inf"), dtype=torch.float32, device=q.device))
    block_size = k_cache.shape[1]
    pos = torch.arange(length, device=q.device)
    slots = tables[:1 if shared else rows, pos // block_size].long() * block_size + pos % block_size
    latent = latent_rows(k_cache, v_cache, slots).float()  # [rows or 1, length, latent]
    past = pos[None, :] >= visible[:, None].long()  # [rows, length]: not seen
    if not shared:  # a row's slots past its sequence's end hold whatever another left there, NaN included
        latent.masked_fill_(past[..., None], 0.0)
    scores = torch.matmul(q.float(), latent.transpose(-1, -2)) * scale  # [rows, heads, length]
    scores.masked_fill_(past[:, None, :], float("-inf"))
    lse = torch.logsumexp(scores, -1)
    weights = torch.exp(scores - _finite(lse)[..., None])
    out = torch.matmul(weights, latent[..., :kv_lora_rank])
    return out.to(q.dtype), lse
