"""Absorbed latent attention (DeepSeek's MLA, kernels.mla_reference) against attention written out in float64, and
the Triton kernel (interpreted on a CPU, fp32: the interpreter's bf16 dot is wrong, as tests/test_cp_kernels.py
says) against the reference: decode rows, a prefill chunk's rows of one sequence, rows that see nothing, and
DeepSeek-V3's own widths (a latent of 576, halves of 288: no power of two)."""
from __future__ import annotations

import math

import pytest
import torch

from kernels import mla_reference

# (rows' sequences, rows' visible counts, sequence lengths, heads, kv_lora_rank, qk_rope_head_dim)
CASES = {
    "decode": ([0, 1, 2], [37, 1, 16], [37, 1, 16], 4, 32, 16),
    "prefill-chunk": ([0, 1, 1, 1, 1, 1], [20, 29, 30, 31, 32, 33], [20, 33], 4, 32, 16),
    "sees-nothing": ([0, 1, 0], [5, 0, 0], [5, 9], 2, 32, 16),
    "v3-widths": ([0, 1], [40, 7], [40, 7], 16, 512, 64),
}


def latent_case(lengths, heads, rank, rope, bs=16, seed=0, dtype=torch.float32):
    """A cache of scattered blocks holding each sequence's latents, and the sequences' block tables."""
    g = torch.Generator().manual_seed(seed)
    per_seq = [max(1, math.ceil(n / bs)) for n in lengths]
    blocks = sum(per_seq) + 2
    perm = torch.randperm(blocks, generator=g).tolist()
    tables, used = [], 0
    for n in per_seq:
        tables.append(perm[used:used + n] + [0] * (max(per_seq) - n))
        used += n
    half = (rank + rope) // 2
    k_cache = torch.randn(blocks, bs, 1, half, generator=g).to(dtype)
    v_cache = torch.randn(blocks, bs, 1, half, generator=g).to(dtype)
    return k_cache, v_cache, torch.tensor(tables, dtype=torch.int32), g


def naive(q, k_cache, v_cache, tables, seqs, visible, scale, rank):
    """One row at a time in float64: softmax over the latents the row sees, the weighted c_kv and the lse."""
    out = torch.zeros(*q.shape[:2], rank, dtype=torch.float64)
    lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float64)
    for t, (s, n) in enumerate(zip(seqs.tolist(), visible.tolist())):
        if n == 0:
            continue
        latent = mla_reference.gather_latent(k_cache, v_cache, tables[s], n).double()  # [n, latent]
        scores = q[t].double() @ latent.T * scale  # [heads, n]
        lse[t] = torch.logsumexp(scores, -1)
        out[t] = torch.softmax(scores, -1) @ latent[:, :rank]
    return out, lse


def _case(name, dtype=torch.float32):
    seqs, visible, lengths, heads, rank, rope = CASES[name]
    k_cache, v_cache, tables, g = latent_case(lengths, heads, rank, rope, dtype=dtype)
    q = torch.randn(len(seqs), heads, rank + rope, generator=g).to(dtype)
    return (q, k_cache, v_cache, tables, torch.tensor(seqs), torch.tensor(visible, dtype=torch.int32),
            (16 + rope) ** -0.5, rank)


@pytest.mark.parametrize("name", list(CASES))
def test_reference_equals_attention_written_out(name):
    args = _case(name)
    out, lse = mla_reference.mla_attention_rows(*args)
    want_out, want_lse = naive(*args)
    torch.testing.assert_close(out.double(), want_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", list(CASES))
def test_triton_equals_reference(name):
    triton_mla = pytest.importorskip("kernels.triton_mla")
    args = _case(name)
    want_out, want_lse = mla_reference.mla_attention_rows(*args)
    out, lse = triton_mla.mla_attention_rows(*args)
    torch.testing.assert_close(out, want_out, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse, want_lse, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(CASES))
def test_cpu_kernel_equals_reference(name, dtype):
    """kernels/csrc/mla_decode.cpp (what a CPU stage runs) against the reference, fp32 and bf16 (fp32 sums in
    both: the bf16 outputs within one rounding); a long context cut into pieces whose partials merge."""
    from kernels import cpu_ops

    if cpu_ops.load() is None:
        pytest.skip("the CPU kernels are not built here")
    args = _case(name, dtype)
    want_out, want_lse = mla_reference.mla_attention_rows(*args)
    out, lse = cpu_ops.mla_attention_rows(*args)
    tol = 2e-5 if dtype == torch.float32 else 1e-2
    assert out.dtype == dtype and lse.dtype == torch.float32
    torch.testing.assert_close(out.float(), want_out.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(lse, want_lse, atol=2e-5, rtol=2e-5)


def test_cpu_kernel_over_many_pieces_and_what_it_refuses():
    from kernels import cpu_ops

    if cpu_ops.load() is None:
        pytest.skip("the CPU kernels are not built here")
    k_cache, v_cache, tables, g = latent_case([1500, 3], 4, 64, 32)
    q = torch.randn(2, 4, 96, generator=g)
    args = (q, k_cache, v_cache, tables, torch.tensor([0, 1]), torch.tensor([1500, 3], dtype=torch.int32), 0.1, 64)
    for got, want in zip(cpu_ops.mla_attention_rows(*args), mla_reference.mla_attention_rows(*args)):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    for change, match in [((4, torch.tensor([0, 2])), "names sequence 2 of 2"),
                          ((5, torch.tensor([1500, 1601], dtype=torch.int32)), "sees 1601 positions"),
                          ((0, q[:, :, :90].contiguous()), "is not the cache's two halves"),
                          ((7, 97), "kv_lora_rank 97 is outside")]:
        bad = list(args)
        bad[change[0]] = change[1]
        with pytest.raises(RuntimeError, match=match):
            cpu_ops.mla_attention_rows(*bad)
    tables[1, 0] = 10_000
    with pytest.raises(RuntimeError, match="block 10000 is outside the latent cache"):
        cpu_ops.mla_attention_rows(*args)


def test_latents_written_by_slot_come_back_whole():
    k_cache, v_cache, tables, g = latent_case([20], 1, 32, 16)
    latent = torch.randn(20, 48, generator=g)
    block = int(tables[0, 0]), int(tables[0, 1])
    slots = torch.tensor([block[p // 16] * 16 + p % 16 for p in range(20)])
    mla_reference.write_latent(latent, k_cache, v_cache, slots)
    assert torch.equal(mla_reference.gather_latent(k_cache, v_cache, tables[0], 20), latent)
    assert torch.equal(k_cache[block[0], :, 0], latent[:16, :24]) and torch.equal(v_cache[block[0], :, 0],
                                                                                   latent[:16, 24:])


@pytest.mark.parametrize("rope", [
    {"factor": 4.0, "original_max_position_embeddings": 128, "mscale": 1.0, "mscale_all_dim": 0.707},
    {"factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 1.0, "mscale_all_dim": 1.0},  # V3's
    {"factor": 8.0, "original_max_position_embeddings": 256, "beta_fast": 16, "truncate": False},
])
def test_yarn_cos_sin_are_transformers(rope):
    """YaRN's frequencies, and its attention factor in cos and sin, as transformers' rope init computes them."""
    from transformers import DeepseekV3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from kernels.reference import build_cos_sin_cache

    params = {"rope_type": "yarn", "rope_theta": 10000.0, **rope}
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](DeepseekV3Config(qk_rope_head_dim=64, rope_parameters=params,
                                                                    max_position_embeddings=512))
    freqs = torch.arange(512).float()[:, None] * inv_freq[None]
    want = torch.cat([freqs.cos(), freqs.sin()], -1) * factor
    torch.testing.assert_close(build_cos_sin_cache(64, 512, 10000.0, params), want, atol=0, rtol=0)
