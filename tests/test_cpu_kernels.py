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


def test_silu_and_mul():
    x = torch.randn(5, 2 * 1536, generator=torch.Generator().manual_seed(4)) * 4
    torch.testing.assert_close(cpu_ops.silu_and_mul(x), reference.silu_and_mul(x), **TOL)
