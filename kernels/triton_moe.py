"""Fused mixture-of-experts in Triton: the (token, k) slots sorted by expert, each expert's group
padded to whole row blocks, then one grouped GEMM for cat(gate, up), SiLU-and-mul, and one
grouped GEMM for down scaled by the routing weight; the sum over k per token last.

The API and semantics of kernels.moe_reference.fused_moe (the oracle, tests under
TRITON_INTERPRET=1). Nothing here waits on the device, so the layer can sit in a CUDA graph.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.moe_reference import check_moe_inputs
from kernels.triton_ops import silu_and_mul

BLOCK_N, BLOCK_K = 64, 32


@triton.jit
def _grouped_gemm_kernel(a_ptr, w_ptr, out_ptr, slots_ptr, block_experts_ptr, weights_ptr, num_slots, N, K,
                         stride_am, stride_we, stride_wn, stride_om, A_ROW_DIV: tl.constexpr,
                         WEIGHTED: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[slot] = a[slot // A_ROW_DIV] @ w[expert]^T (x weight[slot]) for the slots of one row
    block, all routed to the block's expert; padding slots (== num_slots) and blocks past the
    last expert (expert -1) store nothing."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_experts_ptr + pid_m)
    slots = tl.load(slots_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    rows_ok = slots < num_slots  # a block past the last group (expert -1) holds padding only
    a_rows = tl.where(rows_ok, slots // A_ROW_DIV, 0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_ok = offs_n < N
    w_base = w_ptr + tl.maximum(expert, 0).to(tl.int64) * stride_we
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_end = tl.where(expert >= 0, K, 0)  # an empty block reads nothing
    for k0 in range(0, k_end, BLOCK_K):
        k_ok = (k0 + offs_k) < K
        a = tl.load(a_ptr + a_rows[:, None] * stride_am + (k0 + offs_k)[None, :],
                    mask=rows_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_base + offs_n[None, :] * stride_wn + (k0 + offs_k)[:, None],
                    mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
    if WEIGHTED:
        acc = acc * tl.load(weights_ptr + slots, mask=rows_ok, other=0.0)[:, None]
    tl.store(out_ptr + slots[:, None].to(tl.int64) * stride_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=rows_ok[:, None] & n_ok[None, :])


def block_m_for(num_slots: int, num_local: int) -> int:
    """Rows per block: decode gives each expert a few slots (little padding at 16), prefill many."""
    per_expert = num_slots / max(num_local, 1)
    return 16 if per_expert <= 16 else 32 if per_expert <= 64 else 64


def align_slots(topk_ids: torch.Tensor, expert_start: int, num_local: int, block_m: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_slots, block_experts): the slots routed to local experts, grouped by expert, each
    group padded with `num_slots` to a multiple of block_m; the local expert of each row block
    (-1 past the last group). Sized from the shapes alone: no host sync."""
    flat = topk_ids.reshape(-1) - expert_start
    num_slots, dev = flat.numel(), flat.device
    key = torch.where((flat >= 0) & (flat < num_local), flat, num_local)  # num_local: held elsewhere
    order = torch.argsort(key, stable=True)
    counts = torch.zeros(num_local + 1, dtype=torch.int64, device=dev).scatter_add_(0, key, torch.ones_like(key))
    counts = counts[:num_local]
    padded = (counts + block_m - 1) // block_m * block_m
    pad_end = padded.cumsum(0)
    first = counts.cumsum(0) - counts
    max_rows = -(-(num_slots + min(num_local, num_slots) * (block_m - 1)) // block_m) * block_m
    sorted_key = key[order]
    expert = sorted_key.clamp(max=num_local - 1)
    pos = pad_end[expert] - padded[expert] + torch.arange(num_slots, device=dev) - first[expert]
    pos = torch.where(sorted_key < num_local, pos, max_rows)  # held elsewhere: into the spare last row
    sorted_slots = torch.full((max_rows + 1,), num_slots, dtype=torch.int64, device=dev).scatter_(0, pos, order)
    block_experts = torch.searchsorted(pad_end, torch.arange(0, max_rows, block_m, device=dev), right=True)
    return sorted_slots[:max_rows], torch.where(block_experts < num_local, block_experts, -1)


def _grouped_gemm(a, w, out, sorted_slots, block_experts, weights, a_row_div: int, block_m: int) -> None:
    """out[slot] = a[slot // a_row_div] @ w[expert]^T, times weights[slot] when weights are given."""
    n, k = w.shape[1], w.shape[2]
    grid = (block_experts.shape[0], triton.cdiv(n, BLOCK_N))
    _grouped_gemm_kernel[grid](a, w, out, sorted_slots, block_experts, out if weights is None else weights,
                               out.shape[0], n, k, a.stride(0), w.stride(0), w.stride(1), out.stride(0),
                               A_ROW_DIV=a_row_div, WEIGHTED=weights is not None,
                               PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
                               BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)


def fused_moe(x, w13, w2, topk_weights, topk_ids, expert_start=0):
    check_moe_inputs(x, w13, w2, topk_weights, topk_ids)
    tokens, top_k = topk_ids.shape
    if tokens == 0:
        return torch.zeros_like(x)
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    num_local, num_slots = w13.shape[0], tokens * top_k
    block_m = block_m_for(num_slots, num_local)
    sorted_slots, block_experts = align_slots(topk_ids, expert_start, num_local, block_m)
    # zeros: the rows of slots held elsewhere go through SiLU-and-mul too (never read after)
    gate_up = torch.zeros((num_slots, w13.shape[1]), dtype=x.dtype, device=x.device)
    _grouped_gemm(x, w13, gate_up, sorted_slots, block_experts, None, top_k, block_m)
    act = silu_and_mul(gate_up)
    down = torch.zeros((num_slots, x.shape[1]), dtype=torch.float32, device=x.device)
    _grouped_gemm(act, w2, down, sorted_slots, block_experts, topk_weights.reshape(-1).contiguous(), 1, block_m)
    return down.view(tokens, top_k, -1).sum(1).to(x.dtype)
