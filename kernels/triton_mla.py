"""Triton absorbed latent attention (DeepSeek's MLA) over the paged cache: kernels.mla_reference's
mla_attention_rows in one kernel, its oracle in tests/test_mla_kernels.py (TRITON_INTERPRET=1 on a CPU).

One program per (query row, block of heads): the heads share the latents, so each tile of latents is loaded once
for BLOCK_H heads. A latent is its two cache halves (k_cache holds [0, HALF), v_cache [HALF, 2 HALF)); a score is
q[:HALF] . k_half + q[HALF:] . v_half, and the weighted c_kv (the latent's first kv_lora_rank values) is the
weighted k halves followed by the first kv_lora_rank - HALF values of the weighted v halves. Online softmax in fp32.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from stagemesh.core.errors import StagemeshError


@triton.jit
def _mla_rows_kernel(q_ptr, kc_ptr, vc_ptr, bt_ptr, seq_ptr, vis_ptr, out_ptr, lse_ptr, scale, H,
                     stride_qt, stride_qh, stride_cb, stride_cs, stride_bt, stride_ot, stride_oh, stride_lt,
                     HALF: tl.constexpr, HALF_PAD: tl.constexpr, RANK: tl.constexpr, BS: tl.constexpr,
                     TILE: tl.constexpr, BLOCK_H: tl.constexpr, PRECISION: tl.constexpr):
    t = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < H
    seq = tl.load(seq_ptr + t).to(tl.int64)
    visible = tl.load(vis_ptr + t)
    d = tl.arange(0, HALF_PAD)
    dmask = d < HALF
    qmask = hmask[:, None] & dmask[None, :]
    q_row = q_ptr + t * stride_qt + heads[:, None] * stride_qh + d[None, :]
    q1 = tl.load(q_row, mask=qmask, other=0.0)
    q2 = tl.load(q_row + HALF, mask=qmask, other=0.0)
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)
    acc1 = tl.zeros([BLOCK_H, HALF_PAD], tl.float32)
    acc2 = tl.zeros([BLOCK_H, HALF_PAD], tl.float32)
    for start in range(0, visible, TILE):  # every tile holds a visible position: no row of -inf alone
        n = start + tl.arange(0, TILE)
        valid = n < visible
        block = tl.load(bt_ptr + seq * stride_bt + n // BS, mask=valid, other=0).to(tl.int64)
        offs = block[:, None] * stride_cb + (n % BS)[:, None] * stride_cs + d[None, :]
        lmask = valid[:, None] & dmask[None, :]
        k1 = tl.load(kc_ptr + offs, mask=lmask, other=0.0).to(q1.dtype)
        k2 = tl.load(vc_ptr + offs, mask=lmask, other=0.0).to(q1.dtype)
        scores = (tl.dot(q1, tl.trans(k1), input_precision=PRECISION)
                  + tl.dot(q2, tl.trans(k2), input_precision=PRECISION)) * scale
        scores = tl.where(valid[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, 1))
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m - m_new)
        l = l * alpha + tl.sum(p, 1)
        acc1 = acc1 * alpha[:, None] + tl.dot(p.to(q1.dtype), k1, input_precision=PRECISION)
        acc2 = acc2 * alpha[:, None] + tl.dot(p.to(q1.dtype), k2, input_precision=PRECISION)
        m = m_new
    seen = l > 0
    l = tl.where(seen, l, 1.0)  # a row that sees nothing: output 0, lse -inf
    tl.store(lse_ptr + t * stride_lt + heads, tl.where(seen, m + tl.log(l), float("-inf")), mask=hmask)
    out_row = out_ptr + t * stride_ot + heads[:, None] * stride_oh
    dtype = out_ptr.dtype.element_ty
    tl.store(out_row + d[None, :], (acc1 / l[:, None]).to(dtype), mask=hmask[:, None] & (d < RANK)[None, :])
    tl.store(out_row + HALF + d[None, :], (acc2 / l[:, None]).to(dtype),
             mask=hmask[:, None] & (d + HALF < RANK)[None, :])


def mla_attention_rows(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                       row_seqs: torch.Tensor, row_visible: torch.Tensor, scale: float,
                       kv_lora_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """kernels.mla_reference.mla_attention_rows: (weighted c_kv [rows, heads, kv_lora_rank] in q's dtype, lse
    [rows, heads] fp32)."""
    rows, heads, width = q.shape
    half, bs = k_cache.shape[-1], k_cache.shape[1]
    problems = [
        (width == 2 * half, f"queries {width} wide for latents of {2 * half}"),
        (kv_lora_rank <= width, f"kv_lora_rank {kv_lora_rank} is wider than the latent"),
        (k_cache.shape == v_cache.shape and k_cache.shape[2] == 1, "k and v caches must be [blocks, block_size, 1, "
                                                                    "latent / 2] each"),
        (k_cache.is_contiguous() and v_cache.is_contiguous(), "the cache must be contiguous"),
        (bs & (bs - 1) == 0, f"block size {bs} must be a power of two"),
        (q.stride(-1) == 1, "q must be contiguous in the last dim"),
        (row_seqs.shape == row_visible.shape == (rows,), "one sequence and one count of positions per row"),
    ]
    for ok, message in problems:
        if not ok:
            raise StagemeshError(f"mla_attention_rows input: {message}")
    out = torch.empty((rows, heads, kv_lora_rank), dtype=q.dtype, device=q.device)
    lse = torch.empty((rows, heads), dtype=torch.float32, device=q.device)
    if rows == 0:
        return out, lse
    block_h = min(64, max(16, triton.next_power_of_2(heads)))
    tile = max(16, bs) if q.device.type == "cpu" else max(32, bs)
    _mla_rows_kernel[(rows, triton.cdiv(heads, block_h))](
        q, k_cache, v_cache, block_tables, row_seqs.contiguous(), row_visible.to(torch.int32).contiguous(), out, lse,
        scale, heads, q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), block_tables.stride(0),
        out.stride(0), out.stride(1), lse.stride(0), HALF=half, HALF_PAD=max(16, triton.next_power_of_2(half)),
        RANK=kv_lora_rank, BS=bs, TILE=tile, BLOCK_H=block_h,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32")
    return out, lse
