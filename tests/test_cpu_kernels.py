"""The fused C++ CPU kernels against their torch references (the oracle the Triton kernels
answer to as well), and the model served on them against the reference path."""
from __future__ import annotations

import pytest
import torch

from kernel_cases import CASES, dense_attention, paged_case
from kernels import cpu_ops, reference

if cpu_ops.load() is None:
    pytest.skip("the CPU kernels could not be built here (no C++ compiler?)", allow_module_level=True)

TOL = dict(atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("name", list(CASES))
def test_paged_attention_equals_reference_and_dense(name):
    lens_q, lens_ctx, heads, kv_heads, d = CASES[name]
    args = paged_case(lens_q, lens_ctx, heads, kv_heads, d)
    scale = d ** -0.5
    got = cpu_ops.paged_attention(*args, scale)
    torch.testing.assert_close(got, reference.paged_attention(*args, scale), **TOL)
    torch.testing.assert_close(got, dense_attention(*args, scale), **TOL)


def test_decode_attention_long_contexts_many_sequences():
    """Enough work to run on several threads; contexts of many blocks, scattered."""
    args = paged_case([1] * 24, [1 + 37 * i for i in range(24)], 9, 3, 64, seed=5)
    torch.testing.assert_close(cpu_ops.paged_attention(*args, 0.125), dense_attention(*args, 0.125), **TOL)


@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(with_residual):
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(7, 576, generator=g), torch.randn(576, generator=g)
    residual = torch.randn(7, 576, generator=g) if with_residual else None
    for got, want in zip(cpu_ops.rms_norm(x, w, 1e-5, residual), reference.rms_norm(x, w, 1e-5, residual)):
        torch.testing.assert_close(got, want, **TOL)
    heads = torch.randn(3, 4, 64, generator=g).transpose(0, 1)  # q/k norm over head_dim of a strided view
    torch.testing.assert_close(cpu_ops.rms_norm(heads, w[:64], 1e-6)[0], reference.rms_norm(heads, w[:64], 1e-6)[0],
                               **TOL)


def test_rotary_of_strided_qkv_views():
    g = torch.Generator().manual_seed(3)
    cache = reference.build_cos_sin_cache(64, 512, 10000.0, None)
    qkv = torch.randn(5, (6 + 2 + 2) * 64, generator=g)
    q, k, _ = qkv.split([6 * 64, 2 * 64, 2 * 64], -1)
    q, k = q.view(5, 6, 64), k.view(5, 2, 64)
    positions = torch.tensor([0, 3, 64, 300, 511])
    for got, want in zip(cpu_ops.apply_rotary(q, k, positions, cache), reference.apply_rotary(q, k, positions, cache)):
        torch.testing.assert_close(got, want, **TOL)
    for bad in (512, 10**6, -16):  # a wrong index is an error, never a read outside the cache
        with pytest.raises(RuntimeError, match=f"position {bad} is outside the rotary cache of 512"):
            cpu_ops.apply_rotary(q, k, torch.tensor([0, 3, 64, 300, bad]), cache)


def test_decode_attention_refuses_rows_outside_the_tables():
    q = torch.randn(2, 4, 64)
    k_cache = v_cache = torch.zeros(4, 16, 2, 64)
    tables = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    ok = cpu_ops.load().decode_attention(q, k_cache, v_cache, tables, torch.tensor([0, 1]), torch.tensor([5, 20]), 0.1)
    assert ok.shape == q.shape
    for seqs, lens, words in [([0, 2], [5, 5], "names sequence 2 of 2"), ([0, -1], [5, 5], "names sequence -1"),
                              ([0, 1], [5, 33], "sees 33 positions"), ([0], [5], "one sequence and one length")]:
        with pytest.raises(RuntimeError, match=words):
            cpu_ops.load().decode_attention(q, k_cache, v_cache, tables, torch.tensor(seqs), torch.tensor(lens), 0.1)


def test_write_kv_cache_and_bad_slot():
    g = torch.Generator().manual_seed(1)
    k, v = torch.randn(5, 2, 64, generator=g), torch.randn(5, 2, 64, generator=g)
    slots = torch.tensor([0, 17, 18, 47, 3])
    got, want = [torch.zeros(3, 16, 2, 64) for _ in range(2)], [torch.zeros(3, 16, 2, 64) for _ in range(2)]
    cpu_ops.write_kv_cache(k, v, got[0], got[1], slots)
    reference.write_kv_cache(k, v, want[0], want[1], slots)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    with pytest.raises(RuntimeError, match="slot 48 is outside the KV cache"):
        cpu_ops.write_kv_cache(k[:1], v[:1], got[0], got[1], torch.tensor([48]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_and_cache_equals_rotary_then_write(dtype):
    """The fused op gives the bits of apply_rotary + write_kv_cache (the path it replaces) and of the
    composition kernels.dispatch falls back to; q comes back rotated, k and v land in their slots."""
    import kernels

    g = torch.Generator().manual_seed(6)
    cache = reference.build_cos_sin_cache(64, 512, 10000.0, None)
    qkv = torch.randn(5, (6 + 2 + 2) * 64, generator=g).to(dtype)
    positions, slots = torch.tensor([0, 3, 64, 300, 511]), torch.tensor([0, 17, 18, 47, 3])
    q, k, v = qkv.split([6 * 64, 2 * 64, 2 * 64], -1)
    want_q, want_k = cpu_ops.apply_rotary(q.view(5, 6, 64), k.view(5, 2, 64), positions, cache)
    want = [torch.zeros(3, 16, 2, 64, dtype=dtype) for _ in range(2)]
    cpu_ops.write_kv_cache(want_k, v.view(5, 2, 64), *want, slots)
    got = [torch.zeros(3, 16, 2, 64, dtype=dtype) for _ in range(2)]
    got_q = cpu_ops.rotary_and_cache(qkv, 6, 2, positions, cache, *got, slots)
    assert got_q.shape == (5, 6, 64) and got_q.dtype == dtype
    assert torch.equal(got_q, want_q) and torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    composed = [torch.zeros(3, 16, 2, 64) for _ in range(2)]  # an fp32 cache under bf16 qkv: the composition
    composed_q = kernels.rotary_and_cache(qkv, 6, 2, positions, cache, *composed, slots)
    assert torch.equal(composed_q, want_q) and torch.equal(composed[0], want[0].float())
    ref_q, ref_k = reference.apply_rotary(q.view(5, 6, 64), k.view(5, 2, 64), positions, cache)
    torch.testing.assert_close(got_q.float(), ref_q.float(), **(TOL if dtype == torch.float32 else BF16))
    for args, words in [((positions, cache, *got, torch.tensor([0, 17, 18, 47, 48])), "slot 48 is outside"),
                        ((torch.tensor([0, 3, 64, 300, 512]), cache, *got, slots), "position 512 is outside"),
                        ((positions, cache, *got, slots[:4]), "one slot per token: 4 for 5")]:
        with pytest.raises(RuntimeError, match=words):
            cpu_ops.rotary_and_cache(qkv, 6, 2, *args)
    with pytest.raises(RuntimeError, match="qkv must be"):
        cpu_ops.rotary_and_cache(qkv, 5, 2, positions, cache, *got, slots)
    with pytest.raises(RuntimeError, match="the KV cache must be"):
        cpu_ops.rotary_and_cache(qkv, 6, 2, positions, cache, *[torch.zeros(3, 16, 3, 64, dtype=dtype)] * 2, slots)


def test_silu_and_mul():
    x = torch.randn(5, 2 * 1536, generator=torch.Generator().manual_seed(4)) * 4
    torch.testing.assert_close(cpu_ops.silu_and_mul(x), reference.silu_and_mul(x), **TOL)


# -- bf16: stored in bf16, computed in fp32 -------------------------------------------------------
# The reference computes some steps in bf16 (the attention's products, SiLU before the product) where
# the kernels keep fp32, so the two agree within bf16 rounding: a few units of the last place.
BF16 = dict(atol=2e-2, rtol=2e-2)


def test_bf16_kernels_equal_the_reference():
    g = torch.Generator().manual_seed(7)
    x, w, res = (torch.randn(*s, generator=g).bfloat16() for s in ((7, 576), (576,), (7, 576)))
    for got, want in zip(cpu_ops.rms_norm(x, w, 1e-5, res), reference.rms_norm(x, w, 1e-5, res)):
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), want.float(), **BF16)
    # the residual sum is one bf16 rounding of the fp32 sum, exactly
    assert torch.equal(cpu_ops.rms_norm(x, w, 1e-5, res)[1], (x.float() + res.float()).bfloat16())
    gate_up = (torch.randn(5, 2 * 1536, generator=g) * 4).bfloat16()
    torch.testing.assert_close(cpu_ops.silu_and_mul(gate_up).float(), reference.silu_and_mul(gate_up).float(), **BF16)
    cache = reference.build_cos_sin_cache(64, 512, 10000.0, None)
    qkv = torch.randn(5, 10 * 64, generator=g).bfloat16()
    q, k, _ = qkv.split([6 * 64, 2 * 64, 2 * 64], -1)
    positions = torch.tensor([0, 3, 64, 300, 511])
    for got, want in zip(cpu_ops.apply_rotary(q.view(5, 6, 64), k.view(5, 2, 64), positions, cache),
                         reference.apply_rotary(q.view(5, 6, 64), k.view(5, 2, 64), positions, cache)):
        torch.testing.assert_close(got.float(), want.float(), **BF16)
    kv = [torch.zeros(3, 16, 2, 64, dtype=torch.bfloat16) for _ in range(4)]
    k, v = torch.randn(2, 5, 2, 64, generator=g).bfloat16()
    cpu_ops.write_kv_cache(k, v, kv[0], kv[1], torch.tensor([0, 17, 18, 47, 3]))
    reference.write_kv_cache(k, v, kv[2], kv[3], torch.tensor([0, 17, 18, 47, 3]))
    assert torch.equal(kv[0], kv[2]) and torch.equal(kv[1], kv[3])


@pytest.mark.parametrize("name", ["decode", "mixed"])
def test_bf16_paged_attention(name):
    lens_q, lens_ctx = ([1] * 6, [1, 17, 40, 64, 100, 33]) if name == "decode" else ([1, 5, 1], [30, 20, 70])
    args = paged_case(lens_q, lens_ctx, 9, 3, 64, dtype=torch.bfloat16, seed=3)
    got = cpu_ops.paged_attention(*args, 0.125)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), dense_attention(*args, 0.125), **BF16)  # dense: fp32 on bf16 inputs
    torch.testing.assert_close(got.float(), reference.paged_attention(*args, 0.125).float(), **BF16)


def test_bf16_kernels_refuse_mixed_dtypes():
    x = torch.randn(2, 64).bfloat16()
    with pytest.raises(RuntimeError, match="weight must be BFloat16"):
        cpu_ops.rms_norm(x, torch.randn(64), 1e-5)
    q = torch.randn(2, 4, 64).bfloat16()
    cache = torch.zeros(4, 16, 2, 64)
    with pytest.raises(RuntimeError, match="k_cache must be BFloat16"):
        cpu_ops.load().decode_attention(q, cache, cache, torch.zeros(2, 1, dtype=torch.int32), torch.tensor([0, 1]),
                                        torch.tensor([1, 1]), 0.1)


def bf16_families():
    """Every family of linear_bf16; the ones this CPU cannot run are skipped by name."""
    runs = {"avx2": True, "avx512_bf16": cpu_ops.load().bf16_avx512_available()}
    return [pytest.param(f, marks=[] if ok else pytest.mark.skip(reason=f"this CPU has no {f} instructions"))
            for f, ok in runs.items()]


@pytest.mark.parametrize("family", bf16_families())
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 13, 40])
@pytest.mark.parametrize("out_features,in_features,bias", [(16, 64, False), (50, 33, True), (960, 576, False)])
def test_linear_bf16_equals_torch(family, rows, out_features, in_features, bias):
    """Every register tile (1-6 rows, 1-4 blocks, and their tails), an odd K, N not a multiple of the
    16-wide block. avx2 multiplies fp32 x exactly; avx512_bf16 takes x in bf16, as torch's bf16 linear."""
    g = torch.Generator().manual_seed(rows * 1000 + out_features)
    w = (torch.randn(out_features, in_features, generator=g) * 0.1).bfloat16()
    b = torch.randn(out_features, generator=g).bfloat16() if bias else None
    x = torch.randn(rows, in_features, generator=g)
    packed = cpu_ops.pack_bf16_weight(w, family)
    xin = x if family == "avx2" else x.bfloat16().float()
    exact = xin @ w.float().T + (b.float() if bias else 0)  # fp32 sums of bf16 weights: what the kernel computes
    got = cpu_ops.linear_bf16(x, packed, out_features, b)
    assert got.dtype == torch.float32 and got.shape == (rows, out_features)
    torch.testing.assert_close(got, exact, atol=1e-4, rtol=1e-4)
    xb = x.bfloat16()  # bf16 activations: one rounding of the fp32 sum, as torch's bf16 linear
    got_bf16 = cpu_ops.linear_bf16(xb.view(1, rows, in_features), packed, out_features, b)
    assert got_bf16.dtype == torch.bfloat16 and got_bf16.shape == (1, rows, out_features)
    want = torch.nn.functional.linear(xb, w, b)
    torch.testing.assert_close(got_bf16[0].float(), want.float(), **BF16)
    torch.testing.assert_close(got_bf16[0], (xb.float() @ w.float().T + (b.float() if bias else 0)).bfloat16(),
                               atol=0, rtol=2 ** -7)  # at most one bf16 step from rounding the exact sum


def test_linear_bf16_family_is_this_cpus_best_unless_capped(monkeypatch):
    monkeypatch.delenv("STAGEMESH_CPU_ISA", raising=False)
    best = "avx512_bf16" if cpu_ops.load().bf16_avx512_available() else "avx2"
    assert cpu_ops.bf16_family() == best
    assert cpu_ops.pack_bf16_weight(torch.randn(20, 8)).shape == ((2, 8, 16) if best == "avx2" else (2, 4, 32))
    monkeypatch.setenv("STAGEMESH_CPU_ISA", "avx2")  # the cap the benchmarks compare the families with
    assert cpu_ops.bf16_family() == "avx2" and cpu_ops.pack_bf16_weight(torch.randn(20, 8)).shape == (2, 8, 16)
    with pytest.raises(RuntimeError, match="no bf16 linear kernels for the family avx9"):
        cpu_ops.pack_bf16_weight(torch.randn(20, 8), "avx9")


def test_linear_bf16_refuses_what_does_not_fit():
    packed = cpu_ops.pack_bf16_weight(torch.randn(20, 8), "avx2")
    with pytest.raises(RuntimeError, match="x has 9 features, the weight 8"):
        cpu_ops.linear_bf16(torch.randn(2, 9), packed, 20)
    with pytest.raises(RuntimeError, match="out_features 40 does not match"):
        cpu_ops.linear_bf16(torch.randn(2, 8), packed, 40)
    with pytest.raises(RuntimeError, match="packed by pack_bf16_weight"):
        cpu_ops.linear_bf16(torch.randn(2, 8), torch.randn(20, 8), 20)


# -- decode attention by family (kernels/csrc/decode_attention_*.cpp) ---------------------------------

def attention_families():
    """Every family of decode attention; the ones this CPU cannot run are skipped by name."""
    runs = {"portable": True, "avx2": True, "avx512": cpu_ops.load().attention_avx512_available()}
    return [pytest.param(f, marks=[] if ok else pytest.mark.skip(reason=f"this CPU has no {f} instructions"))
            for f, ok in runs.items()]


def decode_case(ctx, heads, kv_heads, d, dtype, seed):
    """Decode rows (one query each) over scattered paged contexts of the given lengths."""
    q, k_cache, v_cache, tables, lens, _ = paged_case([1] * len(ctx), ctx, heads, kv_heads, d, dtype=dtype, seed=seed)
    seqs = torch.arange(len(ctx), dtype=torch.int32)
    return (q, k_cache, v_cache, tables, lens, torch.arange(len(ctx) + 1, dtype=torch.int32)), seqs


@pytest.mark.parametrize("family", attention_families())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,d", [(9, 3, 64), (8, 8, 64), (8, 2, 64), (10, 2, 64), (8, 2, 128),
                                              (4, 1, 256), (6, 3, 80)])
def test_decode_attention_families_equal_dense(family, dtype, heads, kv_heads, d):
    """Groups of 1-5 query heads per KV head (the head blocks of a pass and their tails), head_dim 64, 128,
    256 and 80 (which no family covers: the portable loop), contexts of 1 position to many blocks,
    enough rows to share out over the threads by positions."""
    ctx = [1, 2, 15, 16, 17, 33, 300, 5, 64, 1000, 7, 129] + [40 + 13 * i for i in range(12)]
    args, seqs = decode_case(ctx, heads, kv_heads, d, dtype, seed=heads * d)
    q, k_cache, v_cache, tables, lens, _ = args
    got = cpu_ops.load().decode_attention(q, k_cache, v_cache, tables, seqs, lens, d ** -0.5, family)
    assert got.dtype == dtype and got.shape == q.shape
    kernel = cpu_ops.load().decode_attention_covers(family, d)  # else the portable loop
    if dtype == torch.float32 or not kernel:  # fp32 on the stored (bf16: exactly widened) inputs
        want = dense_attention(*args, d ** -0.5)
        torch.testing.assert_close(got.float(), want, **(TOL if dtype == torch.float32 else BF16))
    else:  # the family kernels weigh the values in bf16, as torch's bf16 attention: fp32 otherwise
        want = decode_rounding_weights(q, k_cache, v_cache, tables, lens, d ** -0.5)
        # a weight may round the other way (its exp is computed otherwise): a bf16 step of one weight
        torch.testing.assert_close(got, want.bfloat16(), atol=2 ** -8, rtol=2 ** -7)
        torch.testing.assert_close(got.float(), reference.paged_attention(*args, d ** -0.5).float(), **BF16)


@pytest.mark.parametrize("family", attention_families())
@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize("ctx", [[1000], [129, 700], [200, 2, 64]])
def test_decode_attention_of_few_rows_cut_into_pieces(family, threads, ctx):
    """Fewer (row, KV head) items than twice the threads: an fp32 item long enough is cut into a piece of
    positions per thread and the pieces' softmax sums merged (one short item stays whole beside them)."""
    args, seqs = decode_case(ctx, 9, 3, 64, torch.float32, seed=len(ctx))
    q, k_cache, v_cache, tables, lens, _ = args
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = cpu_ops.load().decode_attention(q, k_cache, v_cache, tables, seqs, lens, 0.125, family)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(got, dense_attention(*args, 0.125), **TOL)


def decode_rounding_weights(q, k_cache, v_cache, tables, lens, scale):
    """Decode attention in fp32 but for the softmax's weights, rounded to bf16 before they multiply the
    values (the sum that divides stays fp32)."""
    bs, group = k_cache.shape[1], q.shape[1] // k_cache.shape[2]
    out = torch.empty(q.shape)
    for r, n in enumerate(lens.tolist()):
        pos = torch.arange(n)
        slots = tables[r, pos // bs].long(), pos % bs
        k = k_cache[slots].float().repeat_interleave(group, 1).transpose(0, 1)  # [heads, n, d]
        v = v_cache[slots].float().repeat_interleave(group, 1).transpose(0, 1)
        s = (q[r].float()[:, None, :] @ k.transpose(1, 2))[:, 0] * scale  # [heads, n]
        e = torch.exp(s - s.max(-1, keepdim=True).values)
        out[r] = (e.bfloat16().float()[:, None, :] @ v)[:, 0] / e.sum(-1, keepdim=True)
    return out


def test_decode_attention_family_is_this_cpus_best_unless_capped(monkeypatch):
    monkeypatch.delenv("STAGEMESH_CPU_ISA", raising=False)
    assert cpu_ops.attention_family() == ("avx512" if cpu_ops.load().attention_avx512_available() else "avx2")
    monkeypatch.setenv("STAGEMESH_CPU_ISA", "avx2")
    assert cpu_ops.attention_family() == "avx2"
    with pytest.raises(RuntimeError, match="no decode attention for the family sse"):
        args, seqs = decode_case([3], 4, 2, 64, torch.float32, seed=1)
        cpu_ops.load().decode_attention(args[0], args[1], args[2], args[3], seqs, args[4], 0.1, "sse")
