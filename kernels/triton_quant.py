"""The quantised linear on CUDA (Triton): y = x W^T + b with W in kernels/quant_reference.py's layouts,
weight-only: the weights are dequantised in registers a tile at a time and multiplied in x's dtype on the
tensor cores with fp32 sums, so a decode step reads 1 byte a weight (int8, fp8) or half of one (4-bit)
instead of bf16's 2.

- 8-bit: `qs` int8 or float8_e4m3fn [N, K] (--quantization w8a16 / fp8, GGUF Q8_0);
- 4-bit: `qs` uint8 [N, K/2], GGUF's nibble order (Q4_0, Q4_1, Q4_K as groups of 32).
Scales of a whole row (G = K, no mins: w8a16 / fp8) multiply the sums once; group scales (and mins) the
weights before the product. Past DEQUANTISE_ABOVE rows the weight is dequantised whole and cuBLAS multiplies.
The 4-bit tile's low and high nibbles are multiplied by the x columns they
belong to (weights j and j + 16 of each block of 32), so nothing is reordered in registers.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from stagemesh.core.errors import StagemeshError


class TileConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int  # weights along K per iteration (a multiple of 32)
    num_warps: int
    num_stages: int


@triton.jit
def _per_group(row_ptrs, first, GROUPS: tl.constexpr, PER: tl.constexpr):
    """The values (scales or mins) of groups first..first + GROUPS of each weight row (`row_ptrs` [1, N]), each
    repeated over its PER rows of the tile: [GROUPS * PER, N]; a tile inside one group gets [1, N]."""
    if GROUPS <= 1:
        return tl.load(row_ptrs + first)
    else:
        v = tl.load(row_ptrs + first + tl.arange(0, GROUPS)[:, None])
        return tl.reshape(tl.broadcast_to(v[:, None, :], (GROUPS, PER, v.shape[1])), (GROUPS * PER, v.shape[1]))


@triton.jit(do_not_specialize=["M"])  # one compiled kernel for every row count (Triton would specialise M == 1)
def _quant_linear_kernel(x_ptr, q_ptr, s_ptr, mn_ptr, b_ptr, o_ptr, M, N, K, stride_xm, stride_qn, stride_sn,
                         stride_om, GROUP: tl.constexpr, FOUR_BIT: tl.constexpr, ROW_SCALES: tl.constexpr,
                         HAS_MINS: tl.constexpr, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = offs_m < M, offs_n < N
    # rows past M and N read the last row (loads need no masks); their outputs are not stored. int64: a long
    # prefill's [M, N] output passes 2**31 elements
    row_m, row_n = tl.minimum(offs_m, M - 1).to(tl.int64), tl.minimum(offs_n, N - 1).to(tl.int64)
    # a tile holds BLOCK_K weights of each row: BLOCK_K bytes (8-bit) or BLOCK_K / 2 (4-bit, two per byte)
    WIDTH: tl.constexpr = BLOCK_K // 2 if FOUR_BIT else BLOCK_K
    i = tl.arange(0, WIDTH)
    k_of = (i // 16) * 32 + i % 16 if FOUR_BIT else i  # the weight (of the tile) in byte i's low nibble, or byte i
    x_rows = x_ptr + row_m[:, None] * stride_xm
    q_rows = q_ptr + row_n[None, :] * stride_qn
    s_rows = s_ptr + row_n[None, :] * stride_sn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + k_of
        raw = tl.load(q_rows + ((k0 // 2 + i) if FOUR_BIT else k)[:, None])
        xs = tl.load(x_rows + k[None, :])
        if FOUR_BIT:
            # a group's weights are GROUP / 2 bytes of the tile (weights j and j + 16 of a block share a byte)
            scale = _per_group(s_rows, k0 // GROUP, BLOCK_K // GROUP, GROUP // 2)
            lo, hi = (raw & 0xF).to(tl.float32) * scale, (raw >> 4).to(tl.float32) * scale
            if HAS_MINS:
                low = _per_group(mn_ptr + row_n[None, :] * stride_sn, k0 // GROUP, BLOCK_K // GROUP, GROUP // 2)
                lo, hi = lo + low, hi + low
            x_hi = tl.load(x_rows + (k + 16)[None, :])
            if IEEE:
                acc = tl.dot(xs, lo, acc, input_precision="ieee")
                acc = tl.dot(x_hi, hi, acc, input_precision="ieee")
            else:
                acc = tl.dot(xs, lo.to(xs.dtype), acc)
                acc = tl.dot(x_hi, hi.to(x_hi.dtype), acc)
        else:
            if ROW_SCALES:
                w = raw.to(tl.float32).to(xs.dtype)  # int8 and e4m3 values are exact in bf16, fp16 and fp32
            else:
                w = raw.to(tl.float32) * _per_group(s_rows, k0 // GROUP, BLOCK_K // GROUP, GROUP)
                w = w.to(xs.dtype)
            if IEEE:
                acc = tl.dot(xs, w, acc, input_precision="ieee")
            else:
                acc = tl.dot(xs, w, acc)
    if ROW_SCALES:
        acc = acc * tl.load(s_ptr + row_n * stride_sn)[None, :]
    if HAS_BIAS:
        acc = acc + tl.load(b_ptr + row_n).to(tl.float32)[None, :]
    tl.store(o_ptr + row_m[:, None] * stride_om + row_n[None, :], acc.to(o_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


def _block_k(k: int, most: int, group: int) -> int:
    """The largest power of two up to `most` (and at least 32) that divides K, so no tile runs past K, and that
    holds whole groups or lies inside one."""
    b = most
    while k % b or (b % group and group % b):
        b //= 2
    return b


def tile_config(m: int, n: int, k: int, group: int, x_bytes: int = 2, four_bit: bool = False) -> TileConfig:
    """The best tiles of a sweep on an H200 (benchmarks/bench_quant_gpu.py --sweep, the Llama-3.1-8B linears):
    up to 64 rows the weights stream through tiles of 16 rows, with as many bytes in flight per SM as its
    shared memory holds (long K tiles, 5 stages) and N tiles narrow enough that a 4096-row weight still gives
    every SM a program; past 16 rows a wide weight (the merged gate/up) and the 4-bit layouts take wider tiles
    of M. fp32 activations take twice the shared memory: K tiles of 256 at most."""
    most = 512 if x_bytes <= 2 else 256
    if m > 16 and four_bit:
        return TileConfig(32, 64, _block_k(k, 128, group), 4, 4)
    if m > 16 and n > 8192:
        return TileConfig(64, 128, _block_k(k, 128, group), 8, 3)
    if m > 16 or n > 4096:
        return TileConfig(16, 64, _block_k(k, 256, group), 4, 5)
    return TileConfig(16, 32, _block_k(k, most, group), 4, 5)


# Above this many rows (prefill chunks, large decode batches) the weight is dequantised whole into x's dtype
# and multiplied by cuBLAS: it reads 3 bytes a weight more (1 + 2 written) but cuBLAS's tiles beat the fused
# kernel's there (0.3-0.4x bf16 at 256 rows, fused, on an H200)
DEQUANTISE_ABOVE = 64


@triton.jit
def _dequantise_kernel(q_ptr, s_ptr, mn_ptr, w_ptr, N, stride_qn, stride_sn, stride_wn, GROUP: tl.constexpr,
                       FOUR_BIT: tl.constexpr, HAS_MINS: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    row_n = tl.minimum(offs_n, N - 1).to(tl.int64)
    k0 = tl.program_id(1) * BLOCK_K
    WIDTH: tl.constexpr = BLOCK_K // 2 if FOUR_BIT else BLOCK_K
    i = tl.arange(0, WIDTH)
    k = k0 + ((i // 16) * 32 + i % 16 if FOUR_BIT else i)
    raw = tl.load(q_ptr + row_n[:, None] * stride_qn + ((k0 // 2 + i) if FOUR_BIT else k)[None, :])
    at = row_n[:, None] * stride_sn + (k // GROUP)[None, :]
    scale = tl.load(s_ptr + at)
    out = w_ptr + row_n[:, None] * stride_wn
    if FOUR_BIT:
        lo, hi = (raw & 0xF).to(tl.float32) * scale, (raw >> 4).to(tl.float32) * scale
        if HAS_MINS:
            low = tl.load(mn_ptr + at)
            lo, hi = lo + low, hi + low
        tl.store(out + k[None, :], lo.to(w_ptr.dtype.element_ty), mask=n_mask[:, None])
        tl.store(out + (k + 16)[None, :], hi.to(w_ptr.dtype.element_ty), mask=n_mask[:, None])
    else:
        w = raw.to(tl.float32) * scale
        if HAS_MINS:
            w = w + tl.load(mn_ptr + at)
        tl.store(out + k[None, :], w.to(w_ptr.dtype.element_ty), mask=n_mask[:, None])


def dequantise(qs: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """W [N, K] in `dtype` (q * scale (+ min) in fp32, one rounding), on the weights' device."""
    four_bit = qs.dtype == torch.uint8
    n, k = qs.shape[0], qs.shape[1] * (2 if four_bit else 1)
    w = torch.empty((n, k), dtype=dtype, device=qs.device)
    block_k = _block_k(k, 256, 32)
    _dequantise_kernel[(triton.cdiv(n, 32), k // block_k)](
        qs, scales, mins if mins is not None else scales, w, n, qs.stride(0), scales.stride(0), w.stride(0),
        GROUP=k // scales.shape[1], FOUR_BIT=four_bit, HAS_MINS=mins is not None, BLOCK_N=32, BLOCK_K=block_k)
    return w


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise StagemeshError(f"quantised linear (CUDA): {message}")


def quant_linear(x: torch.Tensor, qs: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
                 bias: torch.Tensor | None = None, int8_activations: bool = False,
                 config: TileConfig | None = None) -> torch.Tensor:
    """x W^T + b in x's dtype (fp32 sums); `config` overrides the tile choice (benchmarks)."""
    _check(not int8_activations, "int8 activations (w8a8) are built for CPU stages only; on CUDA the weights "
                                 "alone are quantised (w8a16, fp8, gguf)")
    four_bit = qs.dtype == torch.uint8
    _check(qs.dtype in (torch.uint8, torch.int8, torch.float8_e4m3fn), f"weights of dtype {qs.dtype}")
    k = x.shape[-1]
    n, width = qs.shape
    _check(width * (2 if four_bit else 1) == k, f"x has {k} inputs, the weight {width * (2 if four_bit else 1)}")
    _check(k % 32 == 0, f"{k} inputs: the kernel takes multiples of 32")
    _check(scales.dim() == 2 and scales.shape[0] == n and k % scales.shape[1] == 0 and
           (k // scales.shape[1]) % 32 == 0, f"scales of shape {tuple(scales.shape)} for a weight [{n}, {k}]")
    _check(mins is None or mins.shape == scales.shape, "mins must have the scales' shape")
    _check(bias is None or bias.shape == (n,), f"a bias of shape {None if bias is None else tuple(bias.shape)}")
    _check(qs.is_contiguous() and scales.is_contiguous() and (mins is None or mins.is_contiguous()),
           "weights, scales and mins must be contiguous")
    _check(x.dtype in (torch.float32, torch.bfloat16, torch.float16), f"activations of dtype {x.dtype}")
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    m = rows.shape[0]
    if n and m > DEQUANTISE_ABOVE and config is None:
        return F.linear(rows, dequantise(qs, scales, mins, x.dtype), bias).view(*x.shape[:-1], n)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m and n:
        group = k // scales.shape[1]
        row_scales = group == k and mins is None
        c = config or tile_config(m, n, k, group, x.element_size(), four_bit)
        _check(c.block_k % group == 0 or group % c.block_k == 0, f"tile {c} across groups of {group}")
        grid = (triton.cdiv(m, c.block_m), triton.cdiv(n, c.block_n))
        _quant_linear_kernel[grid](
            rows, qs, scales, mins if mins is not None else scales, bias if bias is not None else scales, out,
            m, n, k, rows.stride(0), qs.stride(0), scales.stride(0), out.stride(0), GROUP=group,
            FOUR_BIT=four_bit, ROW_SCALES=row_scales, HAS_MINS=mins is not None, HAS_BIAS=bias is not None,
            IEEE=x.dtype == torch.float32, BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k,
            num_warps=c.num_warps, num_stages=c.num_stages)
    return out.view(*x.shape[:-1], n)
