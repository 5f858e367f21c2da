"""What a request's parameters do to its row of logits before sampling, in vLLM V1's order: the
allowed tokens, bad words, min_tokens (no stop before it), logit_bias, then the repetition, presence
and frequency penalties; a structured-output constraint's mask last (stagemesh.core.grammar). Each row is
changed in place; rows of requests that ask for none of it are not touched (SamplingParams.controls_tokens,
has_penalty).
SequenceState is a sequence as the sampler and the drafters see it (ends: whether its last token stops it).
"""
from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from stagemesh.core.sampling_params import SamplingParams

if TYPE_CHECKING:
    from stagemesh.core.grammar import Matcher

NEG_INF = float("-inf")


@dataclass
class SequenceState:
    """A sequence as the sampler knows it; the tensors its parameters need are made once, on first use."""
    params: SamplingParams
    prompt: list[int]
    output: list[int] = field(default_factory=list)
    _allowed: torch.Tensor | None = field(default=None, repr=False)  # bool [vocab]: True where not allowed
    _bias: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)
    matcher: Matcher | None = None  # a constrained sequence's
    compiling: Future | None = None  # the matcher, while its grammar compiles (stage_worker.sampler)
    constraint_error: str | None = None  # why its constraint could not be followed (the row then fails)

    def banned_outside_allowed(self, vocab: int, device) -> torch.Tensor:
        if self._allowed is None:
            self._allowed = torch.ones(vocab, dtype=torch.bool, device=device)
            self._allowed[torch.tensor(self.params.allowed_token_ids, dtype=torch.int64, device=device)] = False
        return self._allowed

    def bias(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        if self._bias is None:
            ids, values = zip(*self.params.logit_bias)
            self._bias = (torch.tensor(ids, dtype=torch.int64, device=device),
                          torch.tensor(values, dtype=torch.float32, device=device))
        return self._bias


def ends(state: SequenceState, eos_token_ids: tuple[int, ...]) -> bool:
    """Whether the sequence's last token stops it (the scheduler will finish it: no drafts needed)."""
    p, token = state.params, state.output[-1]
    if len(state.output) < p.min_tokens:
        return False
    return token in p.stop_token_ids or (not p.ignore_eos and token in eos_token_ids)


def has_penalty(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def needs_processing(p: SamplingParams) -> bool:
    return p.controls_tokens or has_penalty(p)


def process_row(row: torch.Tensor, s: SequenceState, eos_token_ids: tuple[int, ...]) -> None:
    """Apply the sequence's token controls and penalties to its fp32 row of logits, in place."""
    p = s.params
    if p.allowed_token_ids:
        row.masked_fill_(s.banned_outside_allowed(row.shape[0], row.device), NEG_INF)
    if p.bad_words_token_ids:
        _ban_bad_words(row, p.bad_words_token_ids, s.output)
    if len(s.output) < p.min_tokens:  # nothing may end the sequence yet
        stops = list(p.stop_token_ids) + ([] if p.ignore_eos else list(eos_token_ids))
        if stops:
            row[torch.tensor(stops, dtype=torch.int64, device=row.device)] = NEG_INF
    if p.logit_bias:
        ids, values = s.bias(row.device)
        row.index_add_(0, ids, values)
    if has_penalty(p):
        _apply_penalties(row, s)
    if s.matcher is not None and not s.matcher.terminated:  # last: what it rules out stays out whatever the bias
        # (terminated: the sequence ended with its stop token; this row is a step scheduled ahead, whose token
        # the scheduler drops)
        try:
            s.matcher.mask(row)
        except RuntimeError as err:  # this sequence's matcher only: its request fails alone
            s.constraint_error = f"the structured output constraint failed: {err}"


def _ban_bad_words(row: torch.Tensor, words: tuple[tuple[int, ...], ...], output: list[int]) -> None:
    """A word's last token is banned where the output so far ends with the rest of the word (vLLM's rule)."""
    banned = [w[-1] for w in words if len(w) == 1 or (len(output) >= len(w) - 1 and
                                                       tuple(output[len(output) - len(w) + 1:]) == w[:-1])]
    if banned:
        row[torch.tensor(banned, dtype=torch.int64, device=row.device)] = NEG_INF


def _apply_penalties(row: torch.Tensor, s: SequenceState) -> None:
    p = s.params
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(s.prompt) | set(s.output)), dtype=torch.int64, device=row.device)
        if seen.numel():
            vals = row[seen]
            row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and s.output:
        counts = torch.bincount(torch.tensor(s.output, device=row.device), minlength=row.shape[0])
        counts = counts[: row.shape[0]].to(row.dtype)
        row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
