"""The fp8 KV cache's kernels (--kv-cache-dtype fp8) against kernels.kv_quant's numbers and the torch reference:
the reference itself against attention over the dequantised cache; the cache writes (C++ and Triton) bit for bit;
the decode attention families (avx2, avx512) and the Triton kernels (TRITON_INTERPRET=1 on CPU) within fp32
rounding, lse included (context parallelism)."""
from __future__ import annotations

import pytest
import torch

from kernel_cases import CASES, dense_attention, paged_case
from kernels import cpu_ops, kv_quant, reference

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
SCALES = (0.011, 0.023)  # random normal keys / values over these: up to ~400, inside e4m3's 448
TOL = dict(atol=2e-5, rtol=2e-5)
BF16 = dict(atol=2e-2, rtol=2e-2)
built = pytest.mark.skipif(cpu_ops.load() is None, reason="the CPU kernels could not be built here")


def fp8_case(name: str, dtype: torch.dtype, q_dtype=torch.float32, seed: int = 0):
    """A paged case (kernel_cases) whose cache is fp8 of the given dtype: (q, k, v, tables, ctx, qsl), scales."""
    lens_q, lens_ctx, heads, kv_heads, d = CASES[name]
    q, k, v, tables, ctx, qsl = paged_case(lens_q, lens_ctx, heads, kv_heads, d, seed=seed)
    ks, vs = SCALES
    return (q.to(q_dtype), kv_quant.quantize(k, ks, dtype), kv_quant.quantize(v, vs, dtype), tables, ctx, qsl), SCALES


def dequantised(args, scales):
    q, k, v, *rest = args
    return (q, kv_quant.dequantize(k, scales[0], torch.float32), kv_quant.dequantize(v, scales[1], torch.float32),
            *rest)


@pytest.mark.parametrize("dtype", FP8)
def test_quantize_saturates_and_rounds_as_torch(dtype):
    top = torch.finfo(dtype).max
    x = torch.tensor([0.0, 1e-9, -3.3, 2.0 * top, -5.0 * top, 0.5 * top, 1.0])
    got = kv_quant.quantize(x, 2.0, dtype)
    assert got.dtype == dtype
    assert got.float()[3] == top and got.float()[4] == -top  # saturated, never inf or NaN
    assert torch.equal(got.float(), (x / 2.0).clamp(-top, top).to(dtype).float())
    exact = torch.tensor([0.5, -1.5, 3.0, 0.0])  # representable: the round trip gives them back
    assert torch.equal(kv_quant.dequantize(kv_quant.quantize(exact, 0.25, dtype), 0.25, torch.float32), exact)
    assert kv_quant.quantize(x, 2.0, torch.bfloat16).dtype == torch.bfloat16  # another dtype: the scale ignored
    assert kv_quant.requantize(got, 2.0, dtype, 2.0) is got
    again = kv_quant.requantize(got, 2.0, dtype, 4.0)  # another scale: read with the old, stored with the new
    assert torch.equal(again.float(), kv_quant.quantize(got.float() * 2.0, 4.0, dtype).float())


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("name", ["mixed-prefill-and-decode-d128", "decode-gqa3-d64-mixed-lengths",
                                  "mixed-d96-not-a-power-of-two"])
def test_reference_reads_an_fp8_cache_as_stored_times_scale(dtype, name):
    args, scales = fp8_case(name, dtype)
    d = args[0].shape[-1]
    got = reference.paged_attention(*args, d ** -0.5, k_scale=scales[0], v_scale=scales[1])
    plain = dequantised(args, scales)
    torch.testing.assert_close(got, reference.paged_attention(*plain, d ** -0.5), atol=0, rtol=0)
    torch.testing.assert_close(got, dense_attention(*plain, d ** -0.5), **TOL)
    out, lse = reference.paged_attention_lse(*args, d ** -0.5, *scales)
    want_out, want_lse = reference.paged_attention_lse(*plain, d ** -0.5)
    torch.testing.assert_close(out, want_out, **TOL)
    torch.testing.assert_close(lse, want_lse, **TOL)


def write_case(dtype):
    g = torch.Generator().manual_seed(1)
    k, v = torch.randn(6, 2, 64, generator=g), torch.randn(6, 2, 64, generator=g)
    k[0, 0, :4] = torch.tensor([1e4, -1e4, 1e-8, 0.0])  # saturated, subnormal, zero
    slots = torch.tensor([0, 17, 18, 47, 3, 30])
    return k.to(dtype), v.to(dtype), slots


def empty_caches(dtype, n=4):
    return [torch.zeros(3, 16, 2, 64, dtype=dtype) for _ in range(n)]


@built
@pytest.mark.parametrize("cache", FP8)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_write_kv_cache_equals_the_reference_bit_for_bit(cache, dtype):
    k, v, slots = write_case(dtype)
    c = empty_caches(cache)
    reference.write_kv_cache(k, v, c[0], c[1], slots, *SCALES)
    cpu_ops.write_kv_cache(k, v, c[2], c[3], slots, *SCALES)
    assert torch.equal(c[0].view(torch.uint8), c[2].view(torch.uint8))
    assert torch.equal(c[1].view(torch.uint8), c[3].view(torch.uint8))
    stored = c[2].view(-1, 2, 64)[0, 0, :4].float()
    assert stored[0] == torch.finfo(cache).max and stored[1] == -torch.finfo(cache).max and stored[3] == 0


@built
@pytest.mark.parametrize("cache", FP8)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_rotary_and_cache_into_fp8_equals_rotary_then_write(cache, dtype):
    """The fused op into an fp8 cache: the bits of the rotation the C++ kernels compute (in bf16, one rounding of
    the fp32 result; the reference's bf16 ops round more often) followed by the reference's quantisation."""
    g = torch.Generator().manual_seed(3)
    cos_sin = reference.build_cos_sin_cache(64, 128, 10000.0, None)
    qkv = (torch.randn(5, (6 + 2 + 2) * 64, generator=g) * 3).to(dtype)
    positions, slots = torch.tensor([0, 3, 64, 100, 127]), torch.tensor([1, 2, 40, 41, 7])
    c = empty_caches(cache)
    q = cpu_ops.rotary_and_cache(qkv, 6, 2, positions, cos_sin, c[0], c[1], slots, *SCALES)
    rq, rk = cpu_ops.apply_rotary(qkv[:, :384].reshape(5, 6, 64), qkv[:, 384:512].reshape(5, 2, 64), positions,
                                  cos_sin)
    reference.write_kv_cache(rk, qkv[:, 512:].reshape(5, 2, 64), c[2], c[3], slots, *SCALES)
    assert torch.equal(q, rq)
    assert torch.equal(c[0].view(torch.uint8), c[2].view(torch.uint8))
    assert torch.equal(c[1].view(torch.uint8), c[3].view(torch.uint8))


def attention_families():
    """The families of decode attention that read an fp8 cache; those this CPU cannot run skipped by name."""
    if cpu_ops.load() is None:
        return [pytest.param("avx2", marks=pytest.mark.skip(reason="the CPU kernels could not be built here"))]
    runs = {"avx2": True, "avx512": cpu_ops.load().attention_avx512_available()}
    return [pytest.param(f, marks=[] if ok else pytest.mark.skip(reason=f"this CPU has no {f} instructions"))
            for f, ok in runs.items()]


@pytest.mark.parametrize("family", attention_families())
@pytest.mark.parametrize("cache", FP8)
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["decode-gqa3-d64-mixed-lengths", "decode-gqa8-d128-one-block",
                                  "prefill-gqa3-d64-chunks", "mixed-prefill-and-decode-d128",
                                  "mixed-d96-not-a-power-of-two"])
def test_cpu_attention_families_read_fp8_as_the_reference(family, cache, q_dtype, name):
    """Every row (decode tokens and prefill chunks) through the family's kernel, the scales folded into the
    query and the output; head_dim 96, which no family covers, takes the torch reference."""
    args, scales = fp8_case(name, cache, q_dtype, seed=7)
    d = args[0].shape[-1]
    cpu_ops.pin_attention_family(family)
    try:
        got = cpu_ops.paged_attention(*args, d ** -0.5, *scales)
        out, lse = cpu_ops.paged_attention_lse(*args, d ** -0.5, *scales)
    finally:
        cpu_ops.pin_attention_family(None)
    want = reference.paged_attention(*args, d ** -0.5, k_scale=scales[0], v_scale=scales[1])
    want_out, want_lse = reference.paged_attention_lse(*args, d ** -0.5, *scales)
    tol = TOL if q_dtype == torch.float32 else BF16
    assert got.dtype == q_dtype
    torch.testing.assert_close(got.float(), want.float(), **tol)
    torch.testing.assert_close(out.float(), want_out.float(), **tol)
    torch.testing.assert_close(lse, want_lse, **(TOL if q_dtype == torch.float32 else dict(atol=1e-3, rtol=1e-3)))


@built
def test_cpu_attention_of_few_long_rows_cut_into_pieces_reads_fp8():
    """A batch of one long fp32 row is cut into a piece per thread (decode_attention_impl.h run_pieces): the
    value scale applies to every piece before the merge."""
    q, k, v, tables, ctx, qsl = paged_case([1], [900], 9, 3, 64, seed=11)
    kc, vc = kv_quant.quantize(k, SCALES[0], FP8[0]), kv_quant.quantize(v, SCALES[1], FP8[0])
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        got = cpu_ops.paged_attention(q, kc, vc, tables, ctx, qsl, 0.125, *SCALES)
    finally:
        torch.set_num_threads(before)
    want = reference.paged_attention(q, kc, vc, tables, ctx, qsl, 0.125, k_scale=SCALES[0], v_scale=SCALES[1])
    torch.testing.assert_close(got, want, **TOL)


@built
def test_the_portable_loop_refuses_an_fp8_cache_by_name():
    (q, k, v, tables, ctx, _), _ = fp8_case("decode-mha-d64", FP8[0])
    seqs = torch.arange(3, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="the portable decode attention reads no fp8 cache"):
        cpu_ops.load().decode_attention(q, k, v, tables, seqs, ctx, 0.125, "portable", *SCALES)


# -- Triton (TRITON_INTERPRET=1 on CPU, for real on CUDA) ----------------------------------------------------

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("cache", FP8)
@pytest.mark.parametrize("name", ["decode-gqa3-d64-mixed-lengths", "prefill-gqa3-d64-chunks",
                                  "mixed-prefill-and-decode-d128"])
def test_triton_attention_reads_fp8_as_the_reference(cache, name):
    triton_ops = pytest.importorskip("kernels.triton_ops")
    from kernels import triton_attention

    args, scales = fp8_case(name, cache)
    on = tuple(a.to(DEVICE) for a in args)
    d = args[0].shape[-1]
    want = reference.paged_attention(*args, d ** -0.5, k_scale=scales[0], v_scale=scales[1])
    torch.testing.assert_close(triton_ops.paged_attention(*on, d ** -0.5, *scales).cpu(), want, **TOL)
    out, lse = triton_attention.paged_attention_lse(*on, d ** -0.5, *scales)
    want_out, want_lse = reference.paged_attention_lse(*args, d ** -0.5, *scales)
    torch.testing.assert_close(out.cpu(), want_out, **TOL)
    torch.testing.assert_close(lse.cpu(), want_lse, **TOL)


@pytest.mark.parametrize("cache", FP8)
def test_triton_rows_lse_reads_fp8_as_the_reference(cache):
    """A context-parallel rank's rows (each sees its own count of positions) over an fp8 cache."""
    from kernels import triton_attention

    (q, k, v, tables, _, _), scales = fp8_case("prefill-gqa3-d64-chunks", cache)
    row_seqs = torch.tensor([0, 1, 1, 1, 2, 2], dtype=torch.int32)
    row_visible = torch.tensor([5, 3, 0, 40, 17, 9], dtype=torch.int32)
    q = q[:6]
    want = reference.paged_attention_rows_lse(q, k, v, tables, row_seqs, row_visible, 0.125, *scales)
    got = triton_attention.paged_attention_rows_lse(*(t.to(DEVICE) for t in (q, k, v, tables, row_seqs,
                                                                             row_visible)), 0.125, *scales)
    for g, w in zip(got, want):
        torch.testing.assert_close(g.cpu(), w, **TOL)


@pytest.mark.parametrize("cache", FP8)
def test_triton_write_kv_cache_into_fp8_equals_the_reference(cache):
    triton_ops = pytest.importorskip("kernels.triton_ops")
    k, v, slots = write_case(torch.float32)
    c = empty_caches(cache)
    reference.write_kv_cache(k, v, c[0], c[1], slots, *SCALES)
    on = [x.to(DEVICE) for x in c[2:]]
    triton_ops.write_kv_cache(k.to(DEVICE), v.to(DEVICE), on[0], on[1], slots.to(DEVICE), *SCALES)
    assert torch.equal(c[0].view(torch.uint8), on[0].cpu().view(torch.uint8))
    assert torch.equal(c[1].view(torch.uint8), on[1].cpu().view(torch.uint8))


@pytest.mark.parametrize("cache", FP8)
def test_triton_rounds_every_fp8_midpoint_and_subnormal_as_torch(cache):
    """Every finite value of the format, the midpoints between neighbours (ties: to even, a carry into the
    exponent included) and a fine sweep over the subnormals: stored as torch's conversion stores them."""
    triton_ops = pytest.importorskip("kernels.triton_ops")
    grid = torch.arange(256, dtype=torch.uint8).view(cache).float()
    grid = grid[torch.isfinite(grid)].unique()
    mids = (grid[1:] + grid[:-1]) / 2
    tiny = torch.linspace(-4, 4, 4001) * torch.finfo(cache).smallest_normal
    x = torch.cat([grid, mids, tiny, mids.nextafter(grid[1:]), mids.nextafter(grid[:-1])])
    x = torch.cat([x, torch.zeros(-len(x) % 64)]).view(-1, 1, 64)
    slots = torch.arange(x.shape[0])
    caches = [torch.zeros(x.shape[0], 1, 1, 64, dtype=cache) for _ in range(4)]
    reference.write_kv_cache(x, x, caches[0], caches[1], slots, 1.0, 1.0)
    on = [c.to(DEVICE) for c in caches[2:]]
    triton_ops.write_kv_cache(x.to(DEVICE), x.to(DEVICE), on[0], on[1], slots.to(DEVICE), 1.0, 1.0)
    assert torch.equal(caches[0].view(torch.uint8), on[0].cpu().view(torch.uint8))
