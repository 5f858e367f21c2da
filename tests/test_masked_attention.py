"""kernels.masked_attention, the torch reference of the attention variants newer families use (a sliding window,
logit softcapping, attention sinks): against attention written out one query at a time, on the paged cases every
kernel is tested on; and kernels.paged_attention sends a layer that asks for one of them there."""
from __future__ import annotations

import math

import pytest
import torch

import kernels
from kernel_cases import CASES, dense_attention, paged_case
from kernels import masked_attention, reference


def written_out(q, k_cache, v_cache, tables, ctx, qsl, scale, window=None, softcap=None, sinks=None):
    """One query and head at a time: its visible keys' scores, capped, with its sink as one more logit."""
    out = torch.zeros_like(q, dtype=torch.float32)
    bs, group = k_cache.shape[1], q.shape[1] // k_cache.shape[2]
    for s in range(ctx.shape[0]):
        c, lo, hi = int(ctx[s]), int(qsl[s]), int(qsl[s + 1])
        rows = torch.arange(c)
        k = k_cache[tables[s, rows // bs].long(), rows % bs].float()
        v = v_cache[tables[s, rows // bs].long(), rows % bs].float()
        for i in range(hi - lo):
            pos = c - (hi - lo) + i
            seen = range(max(0, pos - window + 1) if window else 0, pos + 1)
            for h in range(q.shape[1]):
                logits = [float(q[lo + i, h].float() @ k[j, h // group]) * scale for j in seen]
                logits = [softcap * math.tanh(x / softcap) for x in logits] if softcap else logits
                top = max(logits + ([float(sinks[h])] if sinks is not None else []))
                weights = [math.exp(x - top) for x in logits]
                total = sum(weights) + (math.exp(float(sinks[h]) - top) if sinks is not None else 0.0)
                out[lo + i, h] = sum(w / total * v[j, h // group] for w, j in zip(weights, seen))
    return out


VARIANTS = {
    "window-4": dict(window=4),
    "window-17-past-a-block": dict(window=17),
    "softcap-5": dict(softcap=5.0),
    "sinks": dict(sinks=True),
    "all-three": dict(window=6, softcap=3.0, sinks=True),
}


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("case", ["mixed-prefill-and-decode-d128", "prefill-gqa3-d64-chunks",
                                  "decode-gqa3-d64-mixed-lengths"])
def test_the_reference_matches_attention_written_out(case, variant):
    args, kw, scale, mask = variant_case(case, VARIANTS[variant])
    got = masked_attention.paged_attention_masked(*args, scale, mask)
    torch.testing.assert_close(got.float(), written_out(*args, scale, **kw), atol=1e-5, rtol=1e-5)
    # (dispatch sends it here, or a window and sinks alone to the fused CPU kernel: the same to fp32's rounding)
    torch.testing.assert_close(kernels.paged_attention(*args, scale, mask=mask), got)


def variant_case(case: str, variant: dict, dtype=torch.float32):
    """A paged case, the variant's mask arguments (sinks True: one logit per query head), its scale and mask."""
    args = paged_case(*CASES[case], dtype=dtype)
    kw = dict(variant)
    if kw.get("sinks"):
        kw["sinks"] = torch.linspace(-2.0, 3.0, args[0].shape[1])
    return args, kw, args[0].shape[-1] ** -0.5, masked_attention.AttentionMask(**kw)


@pytest.mark.parametrize("case", ["mixed-prefill-and-decode-d128", "prefill-mha-partial-block"])
def test_with_no_variant_it_is_plain_causal_attention(case):
    args = paged_case(*CASES[case])
    scale = args[0].shape[-1] ** -0.5
    got = masked_attention.paged_attention_masked(*args, scale)
    torch.testing.assert_close(got, reference.paged_attention(*args, scale), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.float(), dense_attention(*args, scale), atol=1e-5, rtol=1e-5)


def test_a_window_wider_than_the_context_changes_nothing():
    args = paged_case(*CASES["mixed-prefill-and-decode-d128"])
    scale = args[0].shape[-1] ** -0.5
    wide = masked_attention.AttentionMask(window=1000)
    torch.testing.assert_close(masked_attention.paged_attention_masked(*args, scale, wide),
                               masked_attention.paged_attention_masked(*args, scale))


def test_linear_rope_scaling_divides_the_frequencies():
    plain = reference.build_cos_sin_cache(16, 64, 10000.0, None)
    linear = reference.build_cos_sin_cache(16, 64, 10000.0, {"rope_type": "linear", "factor": 4.0})
    torch.testing.assert_close(linear[8], plain[2])  # (position 8 at a quarter of the frequencies is position 2)


FUSED = {"window-4": dict(window=4), "window-17-past-a-block": dict(window=17), "sinks": dict(sinks=True),
         "window-6-and-sinks": dict(window=6, sinks=True)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("variant", FUSED)
@pytest.mark.parametrize("case", ["mixed-prefill-and-decode-d128", "prefill-gqa3-d64-chunks",
                                  "decode-gqa3-d64-mixed-lengths", "decode-mha-d64"])
def test_the_fused_cpu_kernel_runs_windows_and_sinks_as_the_reference(case, variant, dtype):
    """Without softcap, kernels.paged_attention sends a window or sinks to the family kernel (each row's positions
    from its window's first; a sink through the row's lse): the reference's output, in fp32 to its rounding, in
    bf16 to bf16's."""
    from kernels import cpu_ops

    args, _, scale, mask = variant_case(case, FUSED[variant], dtype)
    if not cpu_ops.covers(cpu_ops.current_attention_family(), args[0].shape[-1]):
        pytest.skip("no CPU attention family here covers this head_dim")
    want = masked_attention.paged_attention_masked(*args, scale, mask)
    fused = cpu_ops.paged_attention_window(*args, scale, mask)
    assert fused is not None
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(fused.float(), want.float(), **tol)
    torch.testing.assert_close(kernels.paged_attention(*args, scale, mask=mask), fused)  # (dispatch sends it there)


def test_the_fused_kernel_reads_nothing_before_a_window():
    """The hybrid KV cache manager gives a local layer's blocks before its window to other requests: whatever they
    hold then (NaN here) changes nothing."""
    from kernels import cpu_ops

    q, k_cache, v_cache, tables, ctx, qsl = paged_case([1, 1, 1], [40, 70, 33], 4, 2, 64)
    if not cpu_ops.covers(cpu_ops.current_attention_family(), 64):
        pytest.skip("no CPU attention family here covers this head_dim")
    scale, window = 0.125, 20
    mask = masked_attention.AttentionMask(window=window)
    want = cpu_ops.paged_attention_window(q, k_cache, v_cache, tables, ctx, qsl, scale, mask)
    dirty_k, dirty_v = k_cache.clone(), v_cache.clone()
    for s, c in enumerate(ctx.tolist()):
        for p in range(c - window):  # every position before the window
            dirty_k[tables[s, p // 16], p % 16] = dirty_v[tables[s, p // 16], p % 16] = float("nan")
    got = cpu_ops.paged_attention_window(q, dirty_k, dirty_v, tables, ctx, qsl, scale, mask)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, atol=0, rtol=0)
