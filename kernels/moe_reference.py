"""Torch reference of the mixture-of-experts kernels: top-k routing and the experts of one
layer. The oracle of the Triton and C++ versions, and the path where neither runs.

Kernel API (kernels.dispatch): `select_experts(router_logits, top_k, renormalize)` gives
fp32 weights and int64 expert ids, [tokens, top_k] each; `fused_moe(x, w13, w2,
topk_weights, topk_ids, expert_start)` applies the experts this rank holds, w13[e] =
cat(gate, up) rows and w2[e] = down of global expert expert_start + e, to the tokens
routed to them, weighted; slots routed to experts held elsewhere contribute nothing.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from stagemesh.core.errors import StagemeshError


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over the experts in fp32, the top_k largest, renormalised to sum to 1 if asked
    (transformers' Mixtral always, Qwen-MoE and OLMoE per norm_topk_prob)."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights /= weights.sum(dim=-1, keepdim=True)
    return weights, ids


def check_moe_inputs(x, w13, w2, topk_weights, topk_ids) -> None:
    """Shapes and types every implementation relies on; a StagemeshError names what is wrong."""
    def need(cond: bool, message: str) -> None:
        if not cond:
            raise StagemeshError(f"fused_moe input: {message}")

    need(x.dim() == 2 and w13.dim() == 3 and w2.dim() == 3, "x must be [tokens, hidden], w13 and w2 3-d")
    tokens, hidden = x.shape
    experts, two_inter, _ = w13.shape
    need(two_inter % 2 == 0 and w13.shape[2] == hidden, f"w13 {tuple(w13.shape)} must be [experts, 2 * inter, "
                                                        f"{hidden}]")
    need(w2.shape == (experts, hidden, two_inter // 2), f"w2 {tuple(w2.shape)} must be "
                                                          f"{(experts, hidden, two_inter // 2)}")
    need(topk_ids.dim() == 2 and topk_ids.shape[0] == tokens, "topk_ids must be [tokens, top_k]")
    need(topk_weights.shape == topk_ids.shape, "topk_weights and topk_ids must have the same shape")
    need(topk_ids.dtype == torch.int64 and topk_weights.dtype == torch.float32,
         "topk_ids must be int64 and topk_weights float32")
    need(x.dtype == w13.dtype == w2.dtype, "x, w13 and w2 must have one dtype")


def _local_slots(topk_ids: torch.Tensor, expert_start: int, num_local: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(slots, experts): the flattened (token, k) slots routed to this rank's experts, sorted by
    local expert (stable: by token within an expert), and their local expert ids."""
    local = topk_ids.reshape(-1) - expert_start
    slots = ((local >= 0) & (local < num_local)).nonzero().squeeze(1)
    experts = local[slots]
    order = torch.argsort(experts, stable=True)
    return slots[order], experts[order]


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, expert_start: int = 0) -> torch.Tensor:
    """One batched matmul pair per expert that has tokens, accumulated in fp32."""
    check_moe_inputs(x, w13, w2, topk_weights, topk_ids)
    top_k = topk_ids.shape[1]
    slots, experts = _local_slots(topk_ids, expert_start, w13.shape[0])
    counts = torch.bincount(experts, minlength=w13.shape[0]).tolist()
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    weights = topk_weights.reshape(-1)
    start = 0
    for e, n in enumerate(counts):
        if not n:
            continue
        group = slots[start:start + n]
        start += n
        tokens = group // top_k
        gate, up = F.linear(x[tokens], w13[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[e])
        out.index_add_(0, tokens, y.float() * weights[group, None])
    return out.to(x.dtype)
