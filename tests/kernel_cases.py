"""Paged-attention cases shared by the Triton and the CPU kernel tests, and dense attention as the oracle."""
from __future__ import annotations

import math

import torch


def paged_case(lens_q, lens_ctx, heads, kv_heads, d, bs=16, dtype=torch.float32, seed=0, device="cpu"):
    """A batch: seq s has lens_ctx[s] tokens in the cache, the last lens_q[s] of them queried now."""
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [math.ceil(c / bs) for c in lens_ctx]
    num_blocks = sum(blocks_per_seq) + 3
    perm = torch.randperm(num_blocks, generator=g).tolist()  # scattered blocks
    width = max(blocks_per_seq)
    tables, used = [], 0
    for n in blocks_per_seq:
        tables.append(perm[used:used + n] + [0] * (width - n))
        used += n
    k_cache = torch.randn(num_blocks, bs, kv_heads, d, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, bs, kv_heads, d, generator=g).to(dtype)
    q = torch.randn(sum(lens_q), heads, d, generator=g).to(dtype)
    qsl = torch.tensor([0] + list(torch.tensor(lens_q).cumsum(0)), dtype=torch.int32)
    to = lambda t: t.to(device)  # noqa: E731
    return (to(q), to(k_cache), to(v_cache), to(torch.tensor(tables, dtype=torch.int32)),
            to(torch.tensor(lens_ctx, dtype=torch.int32)), to(qsl))


def dense_attention(q, k_cache, v_cache, tables, ctx, qsl, scale):
    """Attention written out for one sequence at a time, no paging tricks."""
    out = torch.empty_like(q, dtype=torch.float32)
    bs, group = k_cache.shape[1], q.shape[1] // k_cache.shape[2]
    for s in range(ctx.shape[0]):
        c, lo, hi = int(ctx[s]), int(qsl[s]), int(qsl[s + 1])
        rows = torch.arange(c)
        k = k_cache[tables[s, rows // bs].long(), rows % bs].float().repeat_interleave(group, 1)  # [c, H, d]
        v = v_cache[tables[s, rows // bs].long(), rows % bs].float().repeat_interleave(group, 1)
        for i in range(hi - lo):
            pos = c - (hi - lo) + i
            w = torch.softmax((q[lo + i].float()[:, None, :] * k[: pos + 1].transpose(0, 1)).sum(-1) * scale, -1)
            out[lo + i] = (w[:, :, None] * v[: pos + 1].transpose(0, 1)).sum(1)
    return out


CASES = {  # (query lens, context lens, heads, kv heads, head dim)
    "decode-gqa3-d64-mixed-lengths": ([1, 1, 1, 1], [1, 16, 17, 40], 6, 2, 64),
    "decode-gqa8-d128-one-block": ([1, 1], [16, 5], 8, 1, 128),
    "decode-mha-d64": ([1, 1, 1], [33, 2, 64], 4, 4, 64),
    "prefill-gqa3-d64-chunks": ([5, 16, 17], [5, 40, 17], 6, 2, 64),
    "mixed-prefill-and-decode-d128": ([1, 20, 1], [30, 20, 9], 8, 1, 128),
    "prefill-mha-partial-block": ([3, 33], [35, 33], 2, 2, 64),
    "mixed-d96-not-a-power-of-two": ([1, 7], [20, 7], 4, 2, 96),
}
