"""Every Triton kernel against its torch reference (under TRITON_INTERPRET=1 on CPU, for real on CUDA),
and the references against dense attention / transformers."""
from __future__ import annotations

import math

import pytest
import torch

from kernels import reference

triton_ops = pytest.importorskip("kernels.triton_ops")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def paged_case(lens_q, lens_ctx, heads, kv_heads, d, bs=16, dtype=torch.float32, seed=0):
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
    to = lambda t: t.to(DEVICE)  # noqa: E731
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


@pytest.mark.parametrize("name", list(CASES))
def test_paged_attention_triton_equals_reference_and_dense(name):
    lens_q, lens_ctx, heads, kv_heads, d = CASES[name]
    args = paged_case(lens_q, lens_ctx, heads, kv_heads, d)
    scale = d ** -0.5
    want = reference.paged_attention(*args, scale)
    got = triton_ops.paged_attention(*args, scale)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(want.float().cpu(), dense_attention(*(a.cpu() for a in args), scale),
                               atol=2e-5, rtol=2e-5)


def test_write_kv_cache_by_slot_mapping():
    g = torch.Generator().manual_seed(1)
    k = torch.randn(5, 2, 64, generator=g).to(DEVICE)
    v = torch.randn(5, 2, 64, generator=g).to(DEVICE)
    slots = torch.tensor([0, 17, 18, 47, 3], dtype=torch.int64, device=DEVICE)
    caches = [torch.zeros(3, 16, 2, 64, device=DEVICE) for _ in range(4)]
    reference.write_kv_cache(k, v, caches[0], caches[1], slots)
    triton_ops.write_kv_cache(k, v, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert torch.equal(caches[0].view(-1, 2, 64)[47], k[3])
    # slot -1 marks a padding row (CUDA-graph batches): nothing is written for it
    padded = torch.tensor([5, -1, -1, 20, -1], dtype=torch.int64, device=DEVICE)
    kc, vc = torch.zeros(3, 16, 2, 64, device=DEVICE), torch.zeros(3, 16, 2, 64, device=DEVICE)
    triton_ops.write_kv_cache(k, v, kc, vc, padded)
    assert torch.equal(kc.view(-1, 2, 64)[5], k[0]) and torch.equal(vc.view(-1, 2, 64)[20], v[3])
    assert int((kc.view(-1, 2, 64).abs().sum((1, 2)) > 0).sum()) == 2


@pytest.mark.parametrize("with_residual", [False, True])
def test_fused_residual_rms_norm(with_residual):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    g = torch.Generator().manual_seed(2)
    x, res = torch.randn(7, 96, generator=g).to(DEVICE), torch.randn(7, 96, generator=g).to(DEVICE)
    w = torch.rand(96, generator=g).to(DEVICE) + 0.5
    residual = res if with_residual else None
    out, new_res = triton_ops.rms_norm(x, w, 1e-6, residual)
    want_out, want_res = reference.rms_norm(x, w, 1e-6, residual)
    torch.testing.assert_close(out, want_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(new_res, want_res)
    hf = LlamaRMSNorm(96, eps=1e-6).to(DEVICE)
    hf.weight.data.copy_(w)
    torch.testing.assert_close(want_out, hf(x + res if with_residual else x), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("scaling", [None, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}])
def test_rotary_matches_transformers(scaling):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    d, theta = 64, 500000.0
    config = LlamaConfig(hidden_size=256, num_attention_heads=4, max_position_embeddings=512, rope_theta=theta,
                         rope_scaling=scaling)
    cache = reference.build_cos_sin_cache(d, 512, theta, scaling, device=DEVICE)
    g = torch.Generator().manual_seed(3)
    q, k = torch.randn(6, 4, d, generator=g).to(DEVICE), torch.randn(6, 2, d, generator=g).to(DEVICE)
    positions = torch.tensor([0, 1, 63, 64, 200, 511], device=DEVICE)
    cos, sin = LlamaRotaryEmbedding(config).to(DEVICE)(q, positions[None])
    want_q, want_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    ref_q, ref_k = reference.apply_rotary(q, k, positions, cache)
    torch.testing.assert_close(ref_q, want_q[0].transpose(0, 1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ref_k, want_k[0].transpose(0, 1), atol=1e-5, rtol=1e-5)
    tri_q, tri_k = triton_ops.apply_rotary(q, k, positions, cache)
    torch.testing.assert_close(tri_q, ref_q, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(tri_k, ref_k, atol=1e-5, rtol=1e-5)


def test_silu_and_mul():
    x = torch.randn(5, 2 * 1500, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    torch.testing.assert_close(triton_ops.silu_and_mul(x), reference.silu_and_mul(x), atol=1e-5, rtol=1e-5)


def test_wrappers_refuse_bad_inputs():
    from stagemesh.errors import StagemeshError

    args = paged_case([1], [4], 4, 2, 40)
    with pytest.raises(StagemeshError, match="head_dim 40 must be a multiple of 16"):
        triton_ops.paged_attention(*args, 0.1)
    args = paged_case([1], [4], 3, 2, 64)
    with pytest.raises(StagemeshError, match="3 query heads are not a multiple of 2 KV heads"):
        triton_ops.paged_attention(*args, 0.1)
