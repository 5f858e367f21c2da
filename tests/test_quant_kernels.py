"""The quantised linear (kernels/csrc/quant_linear.cpp) against its torch reference, on every register-tile
shape of both paths, and what it refuses."""
from __future__ import annotations

import pytest
import torch

from kernels import cpu_ops
from kernels import quant_reference as ref

if cpu_ops.quant_isa() == "none":
    pytest.skip("the AVX2 quantised kernels are not built here (no C++ compiler, or no AVX2)", allow_module_level=True)


def weight(n: int, k: int, bits: int, group: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    scales = torch.rand(n, k // group, generator=g) * 0.02 + 1e-3
    if bits == 4:
        q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
        return ref.pack_4bit(q), scales, -torch.rand(n, k // group, generator=g) * 0.1
    if bits == "fp8":  # normals, subnormals (|v| < 2^-6), zeros and the largest (448), both signs
        spread = torch.tensor([1e-3, 0.05, 3.0, 300.0])[torch.randint(0, 4, (n, k), generator=g)]
        v = torch.randn(n, k, generator=g) * spread
        return v.clamp(-448, 448).to(torch.float8_e4m3fn), scales, None
    return torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8), scales, None


def families(*names):
    """These families of the products; the ones this CPU cannot run are skipped by name."""
    module = cpu_ops.load()
    runs = {"avx2": True, "avx512": module.quant_avx512_available(),
            "avx512_vnni": module.quant_avx512_available() and module.int8_vnni_available(),
            "avx512_bf16": module.quant_bf16_available()}
    return [pytest.param(f, marks=[] if runs[f] else pytest.mark.skip(reason=f"this CPU has no {f} instructions"))
            for f in names]


def check(x, qs, scales, mins, bias, int8_activations, tol=2e-5, family="avx2"):
    got = cpu_ops.quant_linear(x, qs, scales, mins, bias, int8_activations, family)
    want = ref.quant_linear(x, qs, scales, mins, bias, int8_activations)
    assert got.dtype == x.dtype and got.shape == want.shape
    scale = want.float().abs().max().item() + 1e-6
    assert (got.float() - want.float()).abs().max().item() <= tol * scale


# rows of x: the fused path's tiles of 1-4 (and 5-8: a 4 and a rest), the tiled path's 4-row tiles and rests;
# rows of W: the tiled path's 3-row tiles, its 24-row blocks and rests
@pytest.mark.parametrize("family", families("avx2", "avx512", "avx512_bf16"))
@pytest.mark.parametrize("bits", [4, 8, "fp8"])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8, 9, 10, 11, 12, 33])
@pytest.mark.parametrize("n", [1, 2, 3, 25, 50])
def test_exact_path_equals_reference(family, bits, m, n):
    k = 96
    qs, scales, mins = weight(n, k, bits, 32, seed=m * 100 + n)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(n))
    bias = torch.randn(n) if n % 2 else None
    check(x, qs, scales, mins, bias, False, family=family)


@pytest.mark.parametrize("family", families("avx2", "avx512", "avx512_bf16"))
@pytest.mark.parametrize("bits", [4, 8, "fp8"])
@pytest.mark.parametrize("m", [1, 2, 4, 5])
@pytest.mark.parametrize("k,group", [(96, 32), (160, 32), (192, 64), (320, 64), (96, "K"), (160, "K")])
def test_exact_path_group_widths(family, bits, m, k, group):
    """Groups of one chunk and of several (Q8_0's 32, 64, a scale a row as w8a16), an odd and an even number
    of groups a row (the avx512 tile sums even and odd groups apart)."""
    group = k if group == "K" else group
    qs, scales, mins = weight(19, k, bits, group, seed=m + k)
    check(torch.randn(m, k), qs, scales, mins, torch.randn(19), False, family=family)


@pytest.mark.parametrize("family", families("avx2", "avx512", "avx512_vnni", "avx512_bf16"))
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("m", [1, 3, 4, 7, 13])
# groups of one chunk, of two, and one a row (odd and even numbers of chunks)
@pytest.mark.parametrize("k,group", [(192, 32), (192, 64), (192, "K"), (96, 32), (160, "K")])
def test_int8_activations_equal_reference(family, bits, m, k, group):
    group = k if group == "K" else group
    qs, scales, mins = weight(27, k, bits, group, seed=m)
    x = torch.randn(m, k)
    check(x, qs, scales, mins, torch.randn(27), True, tol=1e-5, family=family)
    # the integer sums are exact: every family gives the same bits
    assert torch.equal(cpu_ops.quant_linear(x, qs, scales, mins, None, True, family),
                       cpu_ops.quant_linear(x, qs, scales, mins, None, True, "avx2"))


@pytest.mark.parametrize("family", families("avx2", "avx512_vnni"))
@pytest.mark.parametrize("bits", [4, 8])
def test_an_outlier_blurs_only_its_own_block_of_32(family, bits):
    """int8 activations take a scale per block of 32 of x whatever the weights' group (here one a row, as
    per-channel W8A8 has): an outlier channel (LLMs have them after their norms) coarsens its own block's
    quants only. With the outlier's block multiplied by zero weights, the product is the one without the
    outlier, and within int8's rounding of exact: a few percent of the largest output, where a per-token scale
    (steps of 1000 / 127 over the whole row) would miss by about the output itself."""
    k = 192
    qs, scales, mins = weight(16, k, bits, k, seed=bits)
    if bits == 4:
        mins = torch.zeros_like(mins)
        qs = ref.pack_4bit(ref.unpack_4bit(qs).index_fill(1, torch.arange(96, 128), 0))
    else:
        qs = qs.index_fill(1, torch.arange(96, 128), 0)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(1))
    outlier = x.clone()
    outlier[0, 100] = 1000.0
    got = cpu_ops.quant_linear(outlier, qs, scales, mins, None, True, family)
    assert torch.equal(got, cpu_ops.quant_linear(x.index_fill(1, torch.arange(96, 128), 0), qs, scales, mins, None,
                                                 True, family))
    exact = outlier @ ref.dequantize(qs, scales, mins).T
    assert (got - exact).abs().max() <= 0.05 * exact.abs().max()


@pytest.mark.parametrize("m", [1, 40])
def test_long_k_crosses_the_tiles_and_bf16_activations(m):
    """K past the tiled path's 512-column chunks; bf16 in, bf16 out (one rounding at the end)."""
    k = 1088
    for bits in (4, 8):
        qs, scales, mins = weight(70, k, bits, 32, seed=bits)
        x = torch.randn(m, k)
        check(x, qs, scales, mins, None, False)
        got = cpu_ops.quant_linear(x.bfloat16(), qs, scales, mins, None, False)
        want = ref.quant_linear(x.bfloat16(), qs, scales, mins, None, False)
        torch.testing.assert_close(got.float(), want.float(), atol=0.02 * want.abs().max().item(), rtol=1e-2)


@pytest.mark.parametrize("family", families("avx512_bf16"))
@pytest.mark.parametrize("bits", [4, 8])
def test_pair_tiles_past_a_chunk_of_rows(family, bits):
    """avx512_bf16's many-row tiles (x split into two bf16 against the exact quants) over more than one 256-row
    chunk of x, a last block of 16 rows cut short and a tile of W's rows cut short, within the exact tolerance."""
    qs, scales, mins = weight(100, 192, bits, 32, seed=bits)
    check(torch.randn(300, 192), qs, scales, mins, torch.randn(100), False, family=family)


@pytest.mark.parametrize("family", families("avx512_bf16"))
@pytest.mark.parametrize("bits", [4, 8, "fp8"])
@pytest.mark.parametrize("m,n,k,group,bias", [(3, 50, 96, 32, False), (7, 50, 96, 32, False), (12, 200, 96, 32, True),
                                              (33, 50, 192, 64, False), (300, 200, 160, 160, True)])
def test_bf16_rows_hold_the_weights_as_the_bf16_model_does(family, bits, m, n, k, group, bias):
    """x in bf16 (a model served in bf16), 3 rows or more (register tiles of 1 to 6 rows and 1 to 4 blocks of 16 of
    W's, the last cut short; tiles of W and chunks of x's rows cut short): the weights are the dequantised ones
    rounded to bf16, as transformers' model of the checkpoint in bf16 holds them, and the product is that model's:
    fp32 sums of exact bf16 products (+ the bias), rounded once to bf16 (within a bf16 step of the reference, which
    sums in another order, and equal to it in nearly every element). The weights in bf16 are what it computes, not
    the exact ones: the reference with fp32 weights is further off."""
    qs, scales, mins = weight(n, k, bits, group, seed=m + k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).bfloat16()
    b = torch.randn(n, generator=torch.Generator().manual_seed(k)) if bias else None
    got = cpu_ops.quant_linear(x, qs, scales, mins, b, False, family)
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    want = x.float() @ ref.dequantize(qs, scales, mins).bfloat16().float().T + (0 if b is None else b)
    assert ((got.float() - want).abs() <= want.abs() * 2**-8 + 1e-6 * want.abs().max()).all()
    assert (want.bfloat16() == got).float().mean() >= 0.995
    exact = (x.float() @ ref.dequantize(qs, scales, mins).T + (0 if b is None else b)).bfloat16()
    assert (got != exact).sum() > 2 * (got != want.bfloat16()).sum()


def test_exact_path_gives_the_dequantised_product():
    """The exact path is the fp32 product with the dequantised weights (what the fp32 model computes)."""
    qs, scales, mins = weight(40, 256, 4, 32)
    x = torch.randn(3, 256)
    torch.testing.assert_close(cpu_ops.quant_linear(x, qs, scales, mins, None, False),
                               x @ ref.dequantize(qs, scales, mins).T, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("family", families("avx2", "avx512", "avx512_vnni", "avx512_bf16"))
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("m,int8_activations", [(1, False), (3, False), (12, False), (2, True)])
def test_fp16_scales_give_the_fp32_scales_bits(family, bits, m, int8_activations):
    """Scales (and mins) stored in fp16 (a GGUF's own) are widened exactly: every path (few rows, many rows,
    int8 activations) gives the bits of the same values in fp32, odd group counts included (the 8-wide
    widening and its tail)."""
    qs, scales, mins = weight(27, 32 * 11, bits, 32, seed=m)
    scales = scales.half().float()  # values fp16 holds
    mins = None if mins is None else mins.half().float()
    x = torch.randn(m, 32 * 11, generator=torch.Generator().manual_seed(bits))
    want = cpu_ops.quant_linear(x, qs, scales, mins, None, int8_activations, family)
    got = cpu_ops.quant_linear(x, qs, scales.half(), None if mins is None else mins.half(), None, int8_activations,
                               family)
    assert torch.equal(got, want)


def test_quantized_weight_keeps_fp16_scales_only_where_exact():
    """QuantizedWeight stores a GGUF-like weight's scales in fp16 (what the file holds), keeps scales fp16
    cannot hold in fp32, and its products and rows are the same either way."""
    from stage_worker.quant_weight import QuantizedWeight

    qs, scales, mins = weight(16, 64, 4, 32)
    exact = QuantizedWeight(qs, scales.half().float(), mins.half().float(), "Q4_1")
    assert exact.scales.dtype == exact.mins.dtype == torch.float16
    wide = QuantizedWeight(qs, scales.half().float(), mins.half().float(), "Q4_1", compact_scales=False)
    assert wide.scales.dtype == torch.float32 and exact.nbytes() < wide.nbytes()
    x = torch.randn(2, 64)
    assert torch.equal(exact.linear(x), wide.linear(x))
    assert torch.equal(exact.rows(torch.tensor([3, 0]), torch.float32), wide.rows(torch.tensor([3, 0]), torch.float32))
    assert QuantizedWeight(qs, scales, mins, "Q4_K").scales.dtype == torch.float32  # values fp16 does not hold


def test_refuses_what_does_not_fit():
    qs, scales, mins = weight(8, 64, 4, 32)
    with pytest.raises(RuntimeError, match="K = 48 must be a positive multiple of 32"):
        cpu_ops.quant_linear(torch.randn(2, 48), qs[:, :24].contiguous(), scales, mins, None, False)
    with pytest.raises(RuntimeError, match="qs has 32 bytes a row; K = 96"):
        cpu_ops.quant_linear(torch.randn(2, 96), qs, scales, mins, None, False)
    with pytest.raises(RuntimeError, match="4-bit weights need mins"):
        cpu_ops.quant_linear(torch.randn(2, 64), qs, scales, None, None, False)
    with pytest.raises(RuntimeError, match="3 groups do not split K = 64"):
        cpu_ops.quant_linear(torch.randn(2, 64), qs, torch.rand(8, 3), torch.rand(8, 3), None, False)
    q8, s8, _ = weight(8, 64, 8, 32)
    with pytest.raises(RuntimeError, match="need mins shaped as their scales, in their dtype"):
        cpu_ops.quant_linear(torch.randn(2, 64), qs, scales.half(), mins, None, False)
    with pytest.raises(RuntimeError, match="scales must be contiguous float32 or float16"):
        cpu_ops.quant_linear(torch.randn(2, 64), qs, scales.double(), mins.double(), None, False)
    with pytest.raises(RuntimeError, match="8-bit and fp8 weights take no mins"):
        cpu_ops.quant_linear(torch.randn(2, 64), q8, s8, s8, None, False)
    f8, _, _ = weight(8, 64, "fp8", 32)
    with pytest.raises(RuntimeError, match="int8 activations take integer weights, not float8_e4m3fn"):
        cpu_ops.quant_linear(torch.randn(2, 64), f8, s8, None, None, True)
    with pytest.raises(RuntimeError, match="bias has 3 elements for 8 outputs"):
        cpu_ops.quant_linear(torch.randn(2, 64), q8, s8, None, torch.randn(3), False)
    with pytest.raises(RuntimeError,
                       match=r"no quantised kernels for the family avx9 \(avx2, avx512, avx512_vnni, avx512_bf16\)"):
        cpu_ops.quant_linear(torch.randn(2, 64), q8, s8, None, None, True, "avx9")


def test_int8_per_channel_quantiser_round_trips():
    w = torch.randn(33, 64)
    qs, scales = ref.quantize_int8_per_channel(w)
    assert qs.dtype == torch.int8 and scales.shape == (33, 1) and qs.abs().max() == 127
    assert (ref.dequantize(qs, scales, None) - w).abs().max() <= scales.max() / 2 + 1e-6


def test_a_pinned_family_runs_every_later_product():
    """pin_quant_family (the benchmarks' family comparison) reaches products that name no family; None restores
    this CPU's best."""
    qs, scales, mins = weight(40, 256, 4, 32)
    x = torch.randn(1, 256)
    best = cpu_ops.quant_family()
    if best != "avx2":  # the families sum in another order: the pin shows in the bits
        assert not torch.equal(cpu_ops.quant_linear(x, qs, scales, mins, family="avx2"),
                               cpu_ops.quant_linear(x, qs, scales, mins, family=best))
    try:
        cpu_ops.pin_quant_family("avx2")
        assert torch.equal(cpu_ops.quant_linear(x, qs, scales, mins), cpu_ops.quant_linear(x, qs, scales, mins,
                                                                                            family="avx2"))
        with pytest.raises(ValueError, match="no quantised kernels for the family 'avx9'"):
            cpu_ops.pin_quant_family("avx9")
    finally:
        cpu_ops.pin_quant_family(None)
    assert torch.equal(cpu_ops.quant_linear(x, qs, scales, mins),
                       cpu_ops.quant_linear(x, qs, scales, mins, family=best))
