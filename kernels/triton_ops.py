"""Triton kernels with the kernel API of kernels.reference, each behind a wrapper
that checks its inputs. Used on CUDA tensors (or anywhere under TRITON_INTERPRET=1).

paged_attention takes one of two kernels: a decode kernel when every query
length is 1 (one program per sequence and KV head, all query heads of the group
at once, so each KV block is loaded once per group), and a prefill kernel for
chunks over the paged cache (causal, cached prefix plus the chunk itself), which
also serves decode rows in a mixed batch.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels.kv_quant import is_fp8
from stagemesh.core.errors import StagemeshError


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise StagemeshError(f"kernel input: {message}")


def _check_head_dim(d: int) -> None:
    _check(d % 16 == 0 and 16 <= d <= 256, f"head_dim {d} must be a multiple of 16 up to 256")


# -- KV-cache write ------------------------------------------------------------------------------
@triton.jit
def _fp8_grid(x, MANT: tl.constexpr, MIN_NORMAL: tl.constexpr, STEP: tl.constexpr):
    """fp32 x (within the format's range) rounded to nearest even on the grid of an fp8 format with MANT mantissa
    bits, its smallest normal MIN_NORMAL and its subnormals' step STEP, as an exact fp32: the conversion that
    follows is then exact wherever it runs (Triton's interpreter rounds fp32 -> fp8 half up, dropping the carry
    into the exponent; a GPU's cvt.rn would give these bits anyway)."""
    drop: tl.constexpr = 23 - MANT
    bits = x.to(tl.int32, bitcast=True)
    rounded = (bits + ((1 << (drop - 1)) - 1) + ((bits >> drop) & 1)) & ~((1 << drop) - 1)
    y = tl.minimum(tl.abs(x) / STEP, 1048576.0)  # subnormals: a multiple of STEP, ties to even (exact: a power of two)
    r = tl.floor(y + 0.5)
    r = tl.where((r - y == 0.5) & ((r.to(tl.int32) & 1) != 0), r - 1.0, r)
    sub = tl.where(bits < 0, -r * STEP, r * STEP)  # (the sign bit: -0.0 stays -0.0)
    return tl.where(tl.abs(x) < MIN_NORMAL, sub, rounded.to(tl.float32, bitcast=True))


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, k_scale, v_scale, stride_kt, stride_kh, stride_vt,
                     stride_vh, stride_slot, stride_ch, D: tl.constexpr, D_PAD: tl.constexpr,
                     FP8_MAX: tl.constexpr, MANT: tl.constexpr, MIN_NORMAL: tl.constexpr, STEP: tl.constexpr):
    """FP8_MAX > 0: an fp8 cache, each value stored as x / scale saturated at FP8_MAX and rounded to nearest even
    (kernels.kv_quant), with the format's MANT, MIN_NORMAL and STEP (_fp8_grid)."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    offs = tl.arange(0, D_PAD)
    mask = offs < D
    if slot >= 0:  # slot -1: a padding row (CUDA-graph batches), nothing to write
        k = tl.load(k_ptr + t * stride_kt + h * stride_kh + offs, mask=mask)
        v = tl.load(v_ptr + t * stride_vt + h * stride_vh + offs, mask=mask)
        if FP8_MAX > 0:  # IEEE division, as the reference's
            k = _fp8_grid(tl.clamp(tl.fdiv(k.to(tl.float32), k_scale, ieee_rounding=True), -FP8_MAX, FP8_MAX),
                          MANT, MIN_NORMAL, STEP)
            v = _fp8_grid(tl.clamp(tl.fdiv(v.to(tl.float32), v_scale, ieee_rounding=True), -FP8_MAX, FP8_MAX),
                          MANT, MIN_NORMAL, STEP)
        tl.store(kc_ptr + slot * stride_slot + h * stride_ch + offs, k.to(kc_ptr.dtype.element_ty), mask=mask)
        tl.store(vc_ptr + slot * stride_slot + h * stride_ch + offs, v.to(vc_ptr.dtype.element_ty), mask=mask)


def write_kv_cache(k, v, k_cache, v_cache, slot_mapping, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    tokens, heads, d = k.shape
    _check_head_dim(d)
    _check(k_cache.is_contiguous() and v_cache.is_contiguous(), "the KV cache must be contiguous")
    _check(k_cache.shape[2:] == (heads, d), f"cache heads/dim {tuple(k_cache.shape[2:])} != keys' {(heads, d)}")
    _check(k.stride(-1) == 1 and v.stride(-1) == 1, "keys and values must be contiguous in the last dim")
    _check(slot_mapping.shape == (tokens,), "one slot per token")
    if tokens == 0:
        return
    fp8 = torch.finfo(k_cache.dtype) if is_fp8(k_cache.dtype) else None
    grid = dict(FP8_MAX=0.0, MANT=3, MIN_NORMAL=1.0, STEP=1.0) if fp8 is None else dict(
        FP8_MAX=fp8.max, MANT=round(-math.log2(fp8.eps)), MIN_NORMAL=fp8.smallest_normal,
        STEP=fp8.smallest_normal * fp8.eps)
    _write_kv_kernel[(tokens, heads)](k, v, k_cache, v_cache, slot_mapping, float(k_scale), float(v_scale),
                                      k.stride(0), k.stride(1), v.stride(0), v.stride(1), heads * d, d, D=d,
                                      D_PAD=triton.next_power_of_2(d), **grid)


# -- fused residual add + RMSNorm ----------------------------------------------------------------------
@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, n, eps, stride_x, stride_r, stride_o,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        x += tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(res_out_ptr + row * n + offs, x.to(res_out_ptr.dtype.element_ty), mask=mask)
    var = tl.sum(x * x, axis=0) / n
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = x * tl.rsqrt(var + eps)
    y = y.to(out_ptr.dtype.element_ty).to(tl.float32) * w  # as transformers: normalise in fp32, cast, scale
    tl.store(out_ptr + row * stride_o + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x, weight, eps, residual=None):
    n = x.shape[-1]
    _check(weight.shape == (n,), f"weight of shape {tuple(weight.shape)} for rows of {n}")
    rows = x.reshape(-1, n)
    _check(rows.stride(-1) == 1, "rows must be contiguous")
    out = torch.empty_like(rows)
    if residual is None:
        res_rows, res_out = rows, rows
    else:
        res_rows = residual.reshape(-1, n)
        res_out = torch.empty_like(rows)
    if rows.shape[0]:
        _rms_norm_kernel[(rows.shape[0],)](rows, res_rows, weight, out, res_out, n, eps, rows.stride(0),
                                           res_rows.stride(0), out.stride(0), HAS_RESIDUAL=residual is not None,
                                           BLOCK=triton.next_power_of_2(n))
    return out.view(x.shape), (x if residual is None else res_out.view(x.shape))


# -- rotary embedding (rotate-half layout) ----------------------------------------------------------------
@triton.jit
def _rotary_kernel(q_ptr, k_ptr, qo_ptr, ko_ptr, pos_ptr, cs_ptr, stride_qt, stride_qh, stride_kt, stride_kh,
                   stride_qot, stride_qoh, stride_kot, stride_koh, stride_cs, QH, HALF: tl.constexpr,
                   HALF_PAD: tl.constexpr):
    """One program per (token, head) over q's heads and then k's: both in one launch."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    if h < QH:
        base = q_ptr + t * stride_qt + h * stride_qh
        out = qo_ptr + t * stride_qot + h * stride_qoh
    else:
        base = k_ptr + t * stride_kt + (h - QH) * stride_kh
        out = ko_ptr + t * stride_kot + (h - QH) * stride_koh
    pos = tl.load(pos_ptr + t).to(tl.int64)
    offs = tl.arange(0, HALF_PAD)
    mask = offs < HALF
    cos = tl.load(cs_ptr + pos * stride_cs + offs, mask=mask)
    sin = tl.load(cs_ptr + pos * stride_cs + HALF + offs, mask=mask)
    x1 = tl.load(base + offs, mask=mask).to(tl.float32)
    x2 = tl.load(base + HALF + offs, mask=mask).to(tl.float32)
    tl.store(out + offs, (x1 * cos - x2 * sin).to(out.dtype.element_ty), mask=mask)
    tl.store(out + HALF + offs, (x2 * cos + x1 * sin).to(out.dtype.element_ty), mask=mask)


def apply_rotary(q, k, positions, cos_sin_cache):
    tokens, q_heads, d = q.shape
    _check_head_dim(d)
    _check(k.shape[0] == tokens and k.shape[2] == d, "q and k must have the same tokens and head_dim")
    _check(cos_sin_cache.shape[-1] == d and cos_sin_cache.is_contiguous(),
           "cos_sin_cache must be [positions, head_dim]")
    _check(q.stride(-1) == 1 and k.stride(-1) == 1, "q and k must be contiguous in the last dim")
    q_out, k_out = torch.empty(q.shape, dtype=q.dtype, device=q.device), torch.empty(k.shape, dtype=k.dtype,
                                                                                      device=k.device)
    if tokens:
        _rotary_kernel[(tokens, q_heads + k.shape[1])](
            q, k, q_out, k_out, positions, cos_sin_cache, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1), cos_sin_cache.stride(0), q_heads,
            HALF=d // 2, HALF_PAD=triton.next_power_of_2(d // 2))
    return q_out, k_out


# -- SiLU and mul ---------------------------------------------------------------------------------------------
@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, d, stride_x, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < d
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + d + offs, mask=mask, other=0.0).to(tl.float32)
    y = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * stride_o + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x):
    d = x.shape[-1] // 2
    rows = x.reshape(-1, 2 * d)
    _check(rows.stride(-1) == 1, "input must be contiguous in the last dim")
    out = torch.empty((rows.shape[0], d), dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(d))
    if rows.shape[0]:
        _silu_and_mul_kernel[(rows.shape[0], triton.cdiv(d, block))](rows, out, d, rows.stride(0), out.stride(0),
                                                                      BLOCK=block)
    return out.view(*x.shape[:-1], d)


from kernels.triton_attention import paged_attention  # noqa: E402,F401  (the attention kernels live apart)
from kernels.triton_quant import quant_linear  # noqa: E402,F401  (and the quantised linear)
