"""Sampling on the last stage: logits in, one token per sequence out.

Penalties, temperature, top-k / top-p / min-p, per-request seeds and logprobs.
A seeded request draws its n-th token from a generator seeded with (seed, n),
so its output does not depend on what else is in the batch.

A row that cannot be sampled (non-finite logits, a distribution with no mass)
fails alone: its SampledToken carries the error and the scheduler ends only that
request; the rest of the batch is sampled as usual.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from stagemesh.sampling_params import SamplingParams
from stagemesh.step import NewSequence, SampledToken


@dataclass
class _SeqState:
    params: SamplingParams
    prompt: list[int]
    output: list[int] = field(default_factory=list)


class Sampler:
    def __init__(self, device: str | torch.device = "cpu"):
        self.device = torch.device(device)
        self.seqs: dict[int, _SeqState] = {}
        self._unseeded = torch.Generator(device="cpu").manual_seed(torch.initial_seed() % (2**63))

    def add_sequence(self, seq: NewSequence) -> None:
        self.seqs[seq.seq_id] = _SeqState(seq.sampling, list(seq.prompt_token_ids), list(seq.output_token_ids))

    def remove_sequence(self, seq_id: int) -> None:
        self.seqs.pop(seq_id, None)

    def sample(self, logits: torch.Tensor, seq_ids: list[int]) -> list[SampledToken]:
        states = [self.seqs[s] for s in seq_ids]
        logits = logits.float()
        if any(_has_penalty(s.params) for s in states):
            logits = self._apply_penalties(logits.clone(), states)
        logprobs_raw = None
        if any(s.params.logprobs is not None for s in states):
            logprobs_raw = torch.log_softmax(logits, dim=-1)
        # one host sync for both: NaN or inf anywhere in a row shows in its max
        token_list, finite = torch.stack((logits.argmax(dim=-1), torch.isfinite(logits.amax(dim=-1)))).tolist()
        errors = {i: "the model's logits for this sequence are not finite" for i, ok in enumerate(finite) if not ok}
        for i, s in enumerate(states):
            if not s.params.greedy and i not in errors:
                try:
                    token_list[i] = self._sample_row(logits[i], s)
                except (RuntimeError, ValueError) as err:  # this row's distribution only
                    errors[i] = f"sampling failed: {err}"
        out = []
        for i, (seq_id, state, token) in enumerate(zip(seq_ids, states, token_list)):
            if i in errors:
                # a step run ahead may need this row's token: 0 stands in (its request ends here)
                state.output.append(0)
                out.append(SampledToken(seq_id, 0, error=errors[i]))
                continue
            state.output.append(token)
            out.append(_with_logprobs(SampledToken(seq_id, token), state.params, logprobs_raw, i))
        return out

    def _apply_penalties(self, logits: torch.Tensor, states: list[_SeqState]) -> torch.Tensor:
        for i, s in enumerate(states):
            p = s.params
            if p.repetition_penalty != 1.0:
                seen = torch.tensor(sorted(set(s.prompt) | set(s.output)), dtype=torch.int64, device=logits.device)
                if seen.numel():
                    vals = logits[i, seen]
                    logits[i, seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
            if (p.presence_penalty or p.frequency_penalty) and s.output:
                counts = torch.bincount(torch.tensor(s.output, device=logits.device), minlength=logits.shape[1])
                counts = counts[: logits.shape[1]].to(logits.dtype)
                logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
        return logits

    def _sample_row(self, logits: torch.Tensor, state: _SeqState) -> int:
        p = state.params
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
        gen = self._unseeded
        if p.seed is not None:
            gen = torch.Generator(device="cpu").manual_seed((p.seed * 1_000_003 + len(state.output)) % (2**63))
        # a distribution with no finite mass makes multinomial raise: that row fails alone (see sample)
        return int(torch.multinomial(probs.cpu(), 1, generator=gen))


def _has_penalty(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def _with_logprobs(tok: SampledToken, p: SamplingParams, logprobs: torch.Tensor | None, row: int) -> SampledToken:
    if p.logprobs is None or logprobs is None:
        return tok
    tok.logprob = float(logprobs[row, tok.token_id])
    if p.logprobs > 0:
        top = torch.topk(logprobs[row], p.logprobs)
        tok.top_token_ids = top.indices.tolist()
        tok.top_logprobs = top.values.tolist()
    return tok
