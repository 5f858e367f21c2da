"""Every Triton kernel against its torch reference (under TRITON_INTERPRET=1 on CPU, for real on CUDA),
and the references against dense attention / transformers."""
from __future__ import annotations

import pytest
import torch

from kernel_cases import CASES, dense_attention, paged_case
from kernels import reference

triton_ops = pytest.importorskip("kernels.triton_ops")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("name", list(CASES))
def test_paged_attention_triton_equals_reference_and_dense(name):
    lens_q, lens_ctx, heads, kv_heads, d = CASES[name]
    args = paged_case(lens_q, lens_ctx, heads, kv_heads, d, device=DEVICE)
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
    from stagemesh.core.errors import StagemeshError

    args = paged_case([1], [4], 4, 2, 40, device=DEVICE)
    with pytest.raises(StagemeshError, match="head_dim 40 must be a multiple of 16"):
        triton_ops.paged_attention(*args, 0.1)
    args = paged_case([1], [4], 3, 2, 64, device=DEVICE)
    with pytest.raises(StagemeshError, match="3 query heads are not a multiple of 2 KV heads"):
        triton_ops.paged_attention(*args, 0.1)


# -- the quantised linear (weight-only) --------------------------------------------------------------------
# bf16 runs on CUDA only: Triton's interpreter multiplies bf16 tiles wrongly (fp16 checks the same code path)
QUANT_DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
QUANT_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}  # of max|y|: ~2 roundings of y


def quant_weight(n: int, k: int, layout: str, group: int, seed: int):
    """(qs, scales, mins) of kernels/quant_reference.py's layouts: int8, fp8 or 4-bit with mins."""
    from kernels import quant_reference as qref

    g = torch.Generator().manual_seed(seed)
    scales = torch.rand(n, k // group, generator=g) * 0.02 + 1e-3
    if layout == "4bit":
        q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
        qs, mins = qref.pack_4bit(q), -torch.rand(n, k // group, generator=g) * 0.1
    elif layout == "fp8":
        qs, mins = (torch.randn(n, k, generator=g) * 60).clamp(-448, 448).to(torch.float8_e4m3fn), None
    else:
        qs, mins = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8), None
    return qs.to(DEVICE), scales.to(DEVICE), None if mins is None else mins.to(DEVICE)


# (layout, group): w8a16 and fp8 (a scale per row), GGUF's Q8_0 and Q4_0/Q4_1/Q4_K (groups of 32), wider groups
QUANT_LAYOUTS = [("int8", "K"), ("fp8", "K"), ("int8", 32), ("fp8", 64), ("4bit", 32), ("4bit", 64)]


@pytest.mark.parametrize("layout,group", QUANT_LAYOUTS)
@pytest.mark.parametrize("m", [1, 5, 40, 130])  # decode tiles (16 rows), 64-row and 128-row tiles, two of them
@pytest.mark.parametrize("k", [192, 512])  # K tiles of 64, and of 256 over two iterations
@pytest.mark.parametrize("dtype", QUANT_DTYPES)
def test_quant_linear_triton_equals_reference(layout, group, m, k, dtype):
    from kernels import quant_reference as qref

    n = 50  # not a multiple of any tile: the last tile's rows are cut
    qs, scales, mins = quant_weight(n, k, layout, k if group == "K" else group, seed=m + k)
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=g).to(device=DEVICE, dtype=dtype)
    bias = torch.randn(n, generator=g).to(device=DEVICE, dtype=dtype) if m % 2 else None
    got = triton_ops.quant_linear(x, qs, scales, mins, bias)
    want = qref.quant_linear(x.cpu(), qs.cpu(), scales.cpu(), None if mins is None else mins.cpu(),
                             None if bias is None else bias.cpu())
    assert got.dtype == dtype and got.shape == (m, n)
    err = (got.cpu().float() - want.float()).abs().max().item()
    assert err <= QUANT_TOL[dtype] * want.float().abs().max().item()


@pytest.mark.parametrize("layout,group", [("int8", "K"), ("int8", 32)])
def test_quant_linear_triton_wide_weight_tiles(layout, group):
    """A weight of more than 8192 rows at 17-64 activation rows takes the wide tiles (64 x 128)."""
    from kernels import quant_reference as qref

    n, k, m = 8200, 256, 24
    qs, scales, mins = quant_weight(n, k, layout, k if group == "K" else group, seed=7)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(7)).to(DEVICE)
    got = triton_ops.quant_linear(x, qs, scales, mins)
    want = qref.quant_linear(x.cpu(), qs.cpu(), scales.cpu(), None)
    assert (got.cpu() - want).abs().max().item() <= QUANT_TOL[torch.float32] * want.abs().max().item()


def test_quant_linear_triton_keeps_leading_dims_and_refuses_what_it_cannot_run():
    from stagemesh.core.errors import StagemeshError

    qs, scales, _ = quant_weight(40, 64, "int8", 64, seed=1)
    x = torch.randn(2, 3, 64).to(DEVICE)
    assert triton_ops.quant_linear(x, qs, scales, None).shape == (2, 3, 40)
    for call, words in [
        (lambda: triton_ops.quant_linear(x, qs, scales, None, int8_activations=True), "int8 activations"),
        (lambda: triton_ops.quant_linear(x[..., :48], qs[:, :48].contiguous(), scales, None), "multiples of 32"),
        (lambda: triton_ops.quant_linear(x, qs, scales[:, :1].repeat(1, 3).contiguous(), None), "scales of shape"),
        (lambda: triton_ops.quant_linear(x, qs.float(), scales, None), "weights of dtype"),
    ]:
        with pytest.raises(StagemeshError, match=words):
            call()


@pytest.mark.skipif(DEVICE != "cuda", reason="the dispatch picks Triton for CUDA tensors")
def test_quant_linear_dispatch_runs_triton_on_cuda():
    import kernels
    from kernels import quant_reference as qref

    qs, scales, mins = quant_weight(64, 128, "4bit", 32, seed=2)
    x = torch.randn(3, 128, device="cuda")
    got = kernels.quant_linear(x, qs, scales, mins)
    assert got.is_cuda
    torch.testing.assert_close(got.cpu(), qref.quant_linear(x.cpu(), qs.cpu(), scales.cpu(), mins.cpu()),
                               atol=1e-4, rtol=1e-4)
