"""Multi-LoRA's product in Triton (punica's BGMV shape): y[t] += B[s] (A[s] x[t]) for each token t whose adapter
slot s = token_slots[t] is not -1, every adapter of a batch in one launch of each of two kernels.

- shrink: h[t] = A[s] x[t], one program per token and block of the rank dimension, summed over the input in fp32;
- expand: y[t] += B[s] h[t], one program per token and block of the output.

A and B are a LoRA layer's slots (stage_worker.lora.LoRALinear: A [slots, W, K], B [slots, N, W], W the parts
times the largest rank). kernels.reference.add_lora is the oracle (tests/test_lora.py, under TRITON_INTERPRET=1
on CPU). One matrix-vector product per token serves decode well; a prompt's tokens of one adapter would share
the weights' loads in a segmented (SGMV) kernel, which is not written.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from stagemesh.core.errors import StagemeshError


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, h_ptr, slots_ptr, K, W, stride_xt, stride_as, stride_aw, stride_ht,
                   BLOCK_W: tl.constexpr, BLOCK_K: tl.constexpr):
    t = tl.program_id(0)
    wb = tl.program_id(1)
    s = tl.load(slots_ptr + t).to(tl.int64)
    if s >= 0:
        offs_w = wb * BLOCK_W + tl.arange(0, BLOCK_W)
        acc = tl.zeros((BLOCK_W,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            xk = tl.load(x_ptr + t * stride_xt + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)
            a = tl.load(a_ptr + s * stride_as + offs_w[:, None] * stride_aw + offs_k[None, :],
                        mask=(offs_w[:, None] < W) & (offs_k[None, :] < K), other=0.0).to(tl.float32)
            acc += tl.sum(a * xk[None, :], axis=1)
        tl.store(h_ptr + t * stride_ht + offs_w, acc, mask=offs_w < W)


@triton.jit
def _expand_kernel(h_ptr, b_ptr, y_ptr, slots_ptr, W, N, stride_ht, stride_bs, stride_bn, stride_yt,
                   BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr):
    t = tl.program_id(0)
    nb = tl.program_id(1)
    s = tl.load(slots_ptr + t).to(tl.int64)
    if s >= 0:
        offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for w0 in range(0, W, BLOCK_W):
            offs_w = w0 + tl.arange(0, BLOCK_W)
            hw = tl.load(h_ptr + t * stride_ht + offs_w, mask=offs_w < W, other=0.0)
            b = tl.load(b_ptr + s * stride_bs + offs_n[:, None] * stride_bn + offs_w[None, :],
                        mask=(offs_n[:, None] < N) & (offs_w[None, :] < W), other=0.0).to(tl.float32)
            acc += tl.sum(b * hw[None, :], axis=1)
        y_ptrs = y_ptr + t * stride_yt + offs_n
        y = tl.load(y_ptrs, mask=offs_n < N, other=0.0).to(tl.float32)
        tl.store(y_ptrs, (y + acc).to(y_ptr.dtype.element_ty), mask=offs_n < N)


def add_lora(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
             token_slots: torch.Tensor) -> None:
    """y[t] += lora_b[s] @ (lora_a[s] @ x[t]) for s = token_slots[t] >= 0, in place. x [T, K], y [T, N],
    lora_a [S, W, K], lora_b [S, N, W], token_slots [T] int (-1: no adapter)."""
    tokens, k = x.shape
    slots, w, k_a = lora_a.shape
    n = y.shape[1]
    if (k_a != k or y.shape[0] != tokens or tuple(lora_b.shape) != (slots, n, w) or token_slots.shape != (tokens,)
            or x.stride(1) != 1 or y.stride(1) != 1 or not lora_a.is_contiguous() or not lora_b.is_contiguous()):
        raise StagemeshError(f"kernel input: LoRA shapes x {list(x.shape)}, y {list(y.shape)}, A "
                             f"{list(lora_a.shape)}, B {list(lora_b.shape)}, slots {list(token_slots.shape)} do not "
                             f"fit (row-major last dims)")
    if tokens == 0:
        return
    h = torch.empty(tokens, w, dtype=torch.float32, device=x.device)
    block_w = min(64, triton.next_power_of_2(w))
    _shrink_kernel[(tokens, triton.cdiv(w, block_w))](
        x, lora_a, h, token_slots, k, w, x.stride(0), lora_a.stride(0), lora_a.stride(1), h.stride(0),
        BLOCK_W=block_w, BLOCK_K=64)
    block_n = 64
    _expand_kernel[(tokens, triton.cdiv(n, block_n))](
        h, lora_b, y, token_slots, w, n, h.stride(0), lora_b.stride(0), lora_b.stride(1), y.stride(0),
        BLOCK_N=block_n, BLOCK_W=block_w)
