"""A row's sampling distribution, one draw from it, and speculative decoding's rejection sampling against a
draft's.

Rejection sampling (Leviathan et al. 2023, vLLM's "standard" method): a draft token d drawn from the draft's
distribution q is kept with probability min(1, p(d) / q(d)); when it is not, the token comes from the residual
max(p - q, 0), renormalised. The token that comes out follows the target's p exactly, whatever q is.
"""
from __future__ import annotations

import math

import torch

from stagemesh.core.sampling_params import SamplingParams


def sampling_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The distribution a row of logits [vocab] is sampled from: temperature, top-k, min-p, top-p (vLLM's
    order), normalised. Non-finite or empty rows give a tensor draw() refuses."""
    logits = logits / p.temperature
    if 0 < p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)  # stable (max-subtracted); temperature >= SAMPLING_EPS
    if p.min_p > 0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    if p.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        # keep the smallest prefix whose mass reaches top_p (the first token always stays)
        drop = sorted_probs.cumsum(-1) - sorted_probs >= p.top_p
        probs = probs.scatter(0, order, sorted_probs.masked_fill(drop, 0.0))
    return probs / probs.sum()


def rejection_sample(p: torch.Tensor, q: torch.Tensor, draft: int, gen: torch.Generator) -> int:
    """The token at a draft's position: `draft` itself if kept, else one from the residual (p and q
    normalised, [vocab], on the CPU)."""
    if float(torch.rand((), generator=gen)) * float(q[draft]) <= float(p[draft]):
        return draft
    residual = (p - q).clamp_min_(0.0)
    if float(residual.sum()) <= 0.0:  # p == q up to rounding: nothing is left over
        residual = p
    return draw(residual, gen)


def draw(weights: torch.Tensor, gen: torch.Generator) -> int:
    """One index of `weights` [n] (on the CPU, not necessarily normalised) drawn with probability weight / sum:
    the inverse of the float64 running sum at one uniform draw, so an index of zero weight is never drawn.
    torch.multinomial's one-sample path draws an exponential per entry: ~1 ms a row of a 49K vocabulary on
    a CPU core, against ~0.15 ms here (benchmarks/RESULTS.md, 2026-11-26). Raises ValueError where the weights
    have a negative entry or no finite positive mass (the caller fails that row alone)."""
    cdf = torch.cumsum(weights, 0, dtype=torch.float64)
    total = float(cdf[-1])
    if not (math.isfinite(total) and total > 0) or float(weights.min()) < 0:
        raise ValueError("the sampling distribution has a negative weight or no finite positive mass")
    u = torch.rand((1,), dtype=torch.float64, generator=gen) * total
    index = int(torch.searchsorted(cdf, u, right=True))
    # u < total but for rounding of the product: the last index of positive weight then
    return index if index < weights.numel() else int(torch.nonzero(weights).max())
