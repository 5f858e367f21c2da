"""The torch reference of paged attention with the variants newer families use, alone or together:
- a sliding window (Gemma 3's, gpt-oss's local layers): query at position p sees the keys at positions
  p - window + 1 .. p, as transformers' sliding-window causal mask;
- logit softcapping (Gemma 2's attn_logit_softcapping): scores become cap * tanh(scores / cap) before the mask;
- attention sinks (gpt-oss): a learned logit per query head that joins each row's softmax as one more column
  with no value (it takes a share of the weight and gives nothing back).

Every row of a step (decode tokens and prefill chunks) runs one sequence at a time, in fp32, over only the keys
its window can reach. kernels.dispatch sends a layer here when it asks for softcap, on Triton's devices, and where
no CPU attention family covers its head_dim; a window and sinks alone run the family kernel on CPU
(kernels.cpu_ops.paged_attention_window), which this reference is the oracle of."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kernels.kv_quant import dequantize, is_fp8


@dataclass(frozen=True, eq=False)
class AttentionMask:
    """What a layer's attention adds to the causal mask; a field left None asks for nothing."""
    window: int | None = None  # a sliding window: a query sees this many positions, its own the last
    softcap: float | None = None  # scores become softcap * tanh(scores / softcap)
    sinks: torch.Tensor | None = None  # [heads] logits, this rank's heads

    @property
    def is_plain(self) -> bool:
        """Whether it asks for nothing: plain causal attention."""
        return self.window is None and self.softcap is None and self.sinks is None


PLAIN = AttentionMask()


def paged_attention_masked(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                           context_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float,
                           mask: AttentionMask = PLAIN, *, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """Causal attention of q [tokens, heads, dim] over the paged cache (as kernels.reference.paged_attention),
    with the mask's sliding window, softcap and sinks. An fp8 cache reads as stored * k_scale / v_scale
    (kernels.kv_quant). The output has q's dtype."""
    window = mask.window
    out = torch.empty_like(q)
    starts, lens = query_start_loc.tolist(), context_lens.tolist()
    block_size = k_cache.shape[1]
    for seq, context_len in enumerate(lens):
        lo, hi = starts[seq], starts[seq + 1]
        if hi == lo:
            continue
        # the keys the first of these queries can see onward (the window reaches no further back)
        first = max(0, context_len - (hi - lo) - window + 1) if window is not None else 0
        positions = torch.arange(first, context_len, device=q.device)
        slots = block_tables[seq][positions // block_size].long() * block_size + positions % block_size
        k = k_cache.flatten(0, 1).index_select(0, slots)  # [keys, kv_heads, dim]
        v = v_cache.flatten(0, 1).index_select(0, slots)
        if is_fp8(k.dtype):  # only the keys this sequence reads are widened
            k, v = dequantize(k, k_scale, q.dtype), dequantize(v, v_scale, q.dtype)
        q_positions = torch.arange(context_len - (hi - lo), context_len, device=q.device)
        out[lo:hi] = attention(q[lo:hi], k, v, q_positions, positions, scale, window, mask.softcap, mask.sinks)
    return out


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_positions: torch.Tensor, k_positions: torch.Tensor,
              scale: float, window: int | None = None, softcap: float | None = None,
              sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, H, D] over keys and values [L, KVH, D] at explicit positions (GQA: H a multiple of KVH), in fp32."""
    group = q.shape[1] // k.shape[1]
    keys = k.float().repeat_interleave(group, 1).transpose(0, 1)  # [H, L, D]
    values = v.float().repeat_interleave(group, 1).transpose(0, 1)
    scores = torch.matmul(q.float().transpose(0, 1), keys.transpose(-1, -2)) * scale  # [H, T, L]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    visible = k_positions[None, :] <= q_positions[:, None]  # [T, L]
    if window is not None:
        visible &= k_positions[None, :] > q_positions[:, None] - window
    scores = scores.masked_fill(~visible, -math.inf)
    if sinks is not None:  # one more column per row: the head's sink, which has no value
        sink = sinks.float()[:, None, None].expand(-1, scores.shape[1], 1)
        weights = torch.cat([scores, sink], -1).softmax(-1)[..., :-1]
    else:
        weights = scores.softmax(-1)
    return torch.matmul(weights, values).transpose(0, 1).to(q.dtype)
