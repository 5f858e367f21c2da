"""Multi-LoRA's product in Triton (punica's BGMV shape): y[t] += B[s] (A[s] x[t]) for each token t whose adapter
slot s = token_slots[t] is not -1, every adapter of a batch in two launches of one kernel:

- shrink: h[t] = A[s] x[t], one program per token and block of the rank dimension;
- expand: y[t] += B[s] h[t], one program per token and block of the output;
both one matrix-vector kernel (_bgmv_kernel), summed in fp32.

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
def _bgmv_kernel(v_ptr, m_ptr, out_ptr, slots_ptr, K, R, stride_vt, stride_ms, stride_mr, stride_ot,
                 ACCUMULATE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[t, rows] (+)= M[s] v[t] over a block of M's rows, for the token t's slot s >= 0 (fp32 sums)."""
    t = tl.program_id(0)
    rb = tl.program_id(1)
    s = tl.load(slots_ptr + t).to(tl.int64)
    if s >= 0:
        offs_r = rb * BLOCK_R + tl.arange(0, BLOCK_R)
        acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            vk = tl.load(v_ptr + t * stride_vt + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)
            m = tl.load(m_ptr + s * stride_ms + offs_r[:, None] * stride_mr + offs_k[None, :],
                        mask=(offs_r[:, None] < R) & (offs_k[None, :] < K), other=0.0).to(tl.float32)
            acc += tl.sum(m * vk[None, :], axis=1)
        out_ptrs = out_ptr + t * stride_ot + offs_r
        if ACCUMULATE:
            acc += tl.load(out_ptrs, mask=offs_r < R, other=0.0).to(tl.float32)
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=offs_r < R)


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
    _bgmv_kernel[(tokens, triton.cdiv(w, block_w))](  # shrink: h = A x
        x, lora_a, h, token_slots, k, w, x.stride(0), lora_a.stride(0), lora_a.stride(1), h.stride(0),
        ACCUMULATE=False, BLOCK_R=block_w, BLOCK_K=64)
    _bgmv_kernel[(tokens, triton.cdiv(n, 64))](  # expand: y += B h
        h, lora_b, y, token_slots, w, n, h.stride(0), lora_b.stride(0), lora_b.stride(1), y.stride(0),
        ACCUMULATE=True, BLOCK_R=64, BLOCK_K=block_w)
