"""Torch reference implementations of every kernel: the CPU path and the oracle
the Triton kernels are tested against. Signatures are the kernel API that the
model calls through kernels.dispatch.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from stagemesh.errors import StagemeshError


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """Write this step's keys and values into the paged cache, in place."""
    num_blocks, block_size, heads, dim = k_cache.shape
    k_cache.view(num_blocks * block_size, heads, dim).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(num_blocks * block_size, heads, dim).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    context_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of a mixed batch (prefill chunks and decode tokens) over the paged cache."""
    num_seqs = context_lens.shape[0]
    if q.shape[0] == num_seqs:  # every query length is 1: one batched decode
        return _decode(q, k_cache, v_cache, block_tables, context_lens, scale)
    out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    lens = context_lens.tolist()
    for s in range(num_seqs):
        lo, hi = starts[s], starts[s + 1]
        if hi > lo:
            out[lo:hi] = _one_sequence(q[lo:hi], k_cache, v_cache, block_tables[s], lens[s], scale)
    return out


def _gather(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    block_size = cache.shape[1]
    blocks = block_table[: math.ceil(length / block_size)].long()
    return cache[blocks].flatten(0, 1)[:length]  # [length, kv_heads, dim]


def _one_sequence(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                  context_len: int, scale: float) -> torch.Tensor:
    q_len = q.shape[0]
    k = _gather(k_cache, block_table, context_len).transpose(0, 1)  # [kv_heads, L, d]
    v = _gather(v_cache, block_table, context_len).transpose(0, 1)
    # query i sits at position context_len - q_len + i and sees keys <= its position
    offset = context_len - q_len
    mask = None
    if q_len > 1:
        rows = torch.arange(q_len, device=q.device)[:, None] + offset
        mask = torch.arange(context_len, device=q.device)[None, :] <= rows
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.to(q.dtype), v.to(q.dtype), attn_mask=mask,
                                         scale=scale, enable_gqa=True)
    return out.transpose(0, 1)


# Every layer of a step sees the same metadata tensors: derive what the torch path
# needs from them once per step, not once per layer (the CPU path is overhead-bound).
_step_memo: dict[str, tuple] = {}


def _memo(name: str, keys: tuple, compute):
    hit = _step_memo.get(name)
    if hit is not None and len(hit[0]) == len(keys) and all(a is b for a, b in zip(hit[0], keys)):
        return hit[1]
    value = compute()
    _step_memo[name] = (keys, value)
    return value


def _decode_layout(block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int):
    max_len = int(context_lens.max())
    max_blocks = math.ceil(max_len / block_size)
    blocks = block_tables[:, :max_blocks].reshape(-1).long()
    mask = None
    if int(context_lens.min()) != max_len:
        mask = (torch.arange(max_len, device=context_lens.device)[None, :] < context_lens[:, None])[:, None, None, :]
    return blocks, max_blocks, max_len, mask


def _decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
            context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    seqs, block_size, heads, dim = q.shape[0], k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    blocks, max_blocks, max_len, mask = _memo("decode", (block_tables, context_lens),
                                              lambda: _decode_layout(block_tables, context_lens, block_size))

    def gather(cache):  # [seqs, kv_heads, L, d]
        rows = cache.view(cache.shape[0], -1).index_select(0, blocks)
        return rows.view(seqs, max_blocks * block_size, heads, dim)[:, :max_len].transpose(1, 2).to(q.dtype)

    out = F.scaled_dot_product_attention(q[:, :, None, :], gather(k_cache), gather(v_cache), attn_mask=mask,
                                         scale=scale, enable_gqa=True)
    return out[:, :, 0, :]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(Fused residual add +) RMSNorm, computed in fp32 as transformers does."""
    if residual is not None:
        x = x + residual
    if x.dtype == torch.float32:  # one fused op, same arithmetic
        return F.rms_norm(x, (x.shape[-1],), weight, eps), x
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype), x


def apply_rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                 cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding in the rotate-half (NeoX / transformers Llama) layout."""
    cos, sin = _memo("rotary", (positions, cos_sin_cache), lambda: _cos_sin(positions, cos_sin_cache, q.dtype))
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _cos_sin(positions: torch.Tensor, cos_sin_cache: torch.Tensor, dtype: torch.dtype):
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)  # [tokens, dim/2] each
    return (torch.cat((cos, cos), dim=-1)[:, None, :].to(dtype), torch.cat((sin, sin), dim=-1)[:, None, :].to(dtype))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos) + (rotated * sin)


def build_cos_sin_cache(head_dim: int, max_positions: int, rope_theta: float, rope_scaling: dict | None,
                        dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> torch.Tensor:
    """cat(cos, sin) per position, [max_positions, head_dim], as transformers computes them in fp32."""
    inv_freq = 1.0 / (rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = (rope_scaling or {}).get("rope_type", "default")
    if rope_type == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, rope_scaling)
    elif rope_type != "default":
        raise StagemeshError(f"rope scaling {rope_type!r} is not supported (default and llama3 are)")
    positions = torch.arange(max_positions, dtype=torch.int64).float()
    freqs = positions[:, None] * inv_freq[None, :]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(dtype=dtype, device=device)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_len = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
