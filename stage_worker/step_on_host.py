"""What a step's sampling needs from the device, computed there for the whole batch and brought to the host in
one copy (stage_worker.host_copy): each row's greedy token and whether it can be sampled at all, the sampling
distribution of each row drawn on the host (its generator is a CPU one, so a seeded request draws the same tokens
on any device), a draft model's distribution of each draft to verify against, and logprobs for the rows that ask.
The sampler then draws row by row on the host, with no further sync.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from stagemesh.core.sampling_params import SamplingParams
from stagemesh.core.step import SampledToken
from stage_worker.host_copy import to_host
from stage_worker.rejection import sampling_probs

NOT_FINITE = "the model's logits for this sequence are not finite"
NO_TOKEN_LEFT = ("no token can be sampled: allowed_token_ids, bad_words, min_tokens and the structured output "
                 "constraint rule out every one")


@dataclass(frozen=True)
class Rows:
    """One sequence's rows of the step's logits: its first, and one more per draft to verify."""
    first: int
    params: SamplingParams
    draft: list[int]
    draft_probs: list[torch.Tensor] | None  # the draft model's distribution of each draft, where it sampled them

    def indices(self) -> range:
        return range(self.first, self.first + len(self.draft) + 1)

    def against(self) -> list[tuple[int, int, torch.Tensor]]:
        """(row, draft, its distribution) for each row whose draft is kept or replaced by rejection sampling:
        an unseeded sampled sequence's, where the draft model sampled it."""
        qs = self.draft_probs
        if qs is None or self.params.greedy or self.params.seed is not None:
            return []
        return [(self.first + j, self.draft[j], qs[j]) for j in range(min(len(qs), len(self.draft) + 1))]


class StepOnHost:
    """The step's rows as the host sees them, after the one copy."""

    def __init__(self, tokens: list[int], errors: dict[int, str], probs: dict[int, torch.Tensor],
                 against: dict[int, tuple[int, torch.Tensor]], logprobs: _Logprobs | None):
        self._tokens, self._errors, self._probs, self._against = tokens, errors, probs, against
        self._logprobs = logprobs

    @classmethod
    def gather(cls, raw: torch.Tensor, logits: torch.Tensor, seqs: list[Rows]) -> StepOnHost:
        """raw: the model's fp32 logits [rows, vocab]; logits: the same after each request's processing."""
        # NaN or inf anywhere in a row shows in its max
        parts = [logits.argmax(dim=-1), torch.isfinite(raw.amax(dim=-1)), logits.amax(dim=-1) > float("-inf")]
        sampled = [(row, s.params) for s in seqs if not s.params.greedy for row in s.indices()]
        if sampled:
            parts.append(torch.stack([sampling_probs(logits[row], p) for row, p in sampled]))
        against = [a for s in seqs for a in s.against()]
        if against:
            parts.append(torch.stack([q if q.device == logits.device else q.to(logits.device)
                                      for _, _, q in against]))
        wanted = _Logprobs.wanted(seqs)
        if wanted:
            parts += _Logprobs.on_device(raw, parts[0], wanted)
        host = to_host(parts)
        tokens, finite, open_ = host[0].tolist(), host[1].tolist(), host[2].tolist()
        errors = {r: NOT_FINITE if not ok else NO_TOKEN_LEFT
                  for r, (ok, some) in enumerate(zip(finite, open_)) if not (ok and some)}
        rest = host[3:]
        probs = dict(zip((row for row, _ in sampled), rest.pop(0))) if sampled else {}
        verify = {row: (draft, q) for (row, draft, _), q in zip(against, rest.pop(0))} if against else {}
        return cls(tokens, errors, probs, verify, _Logprobs(wanted, rest) if wanted else None)

    def greedy_token(self, row: int) -> int:
        return self._tokens[row]

    def error(self, row: int) -> str | None:
        """Why the row cannot be sampled at all, if it cannot."""
        return self._errors.get(row)

    def probs(self, row: int) -> torch.Tensor:
        """A sampled row's distribution [vocab], on the host."""
        return self._probs[row]

    def against(self, row: int) -> tuple[int, torch.Tensor] | None:
        """(the row's draft, the draft model's distribution it was drawn from), to verify by rejection sampling."""
        return self._against.get(row)

    def with_logprobs(self, tok: SampledToken, p: SamplingParams, row: int) -> SampledToken:
        if p.logprobs is None or self._logprobs is None:
            return tok
        return self._logprobs.fill(tok, row, self._tokens[row])


class _Logprobs:
    """Logprobs of the model's own distribution, before the request's processing (vLLM V1's default), for the
    rows that ask: the greedy token's gathered on the device, a sampled row's whole row (its token is drawn on the
    host), the top ones by each asked count."""

    def __init__(self, wanted: dict[int, SamplingParams], host: list[torch.Tensor]):
        order = sorted(wanted)
        self._greedy = dict(zip(order, host[0].tolist()))
        sampled = [r for r in order if not wanted[r].greedy]
        self._rows = dict(zip(sampled, host[1])) if sampled else {}
        tops = host[2 if sampled else 1:]
        self._top: dict[int, tuple[list[int], list[float]]] = {}
        for k, (values, indices) in zip(_counts(wanted), zip(tops[::2], tops[1::2])):
            rows = [r for r in order if wanted[r].logprobs == k]
            self._top.update(zip(rows, zip(indices.tolist(), values.tolist())))

    @staticmethod
    def wanted(seqs: list[Rows]) -> dict[int, SamplingParams]:
        return {row: s.params for s in seqs if s.params.logprobs is not None for row in s.indices()}

    @staticmethod
    def on_device(raw: torch.Tensor, greedy: torch.Tensor, wanted: dict[int, SamplingParams]) -> list[torch.Tensor]:
        order = sorted(wanted)
        index = torch.tensor(order, dtype=torch.int64, device=raw.device)
        # the rows that ask only (row i of `logprobs` is row order[i]): a log-softmax is a row's own
        logprobs = torch.log_softmax(raw.index_select(0, index), dim=-1)
        parts = [logprobs.gather(1, greedy.index_select(0, index)[:, None])[:, 0]]
        sampled = [i for i, r in enumerate(order) if not wanted[r].greedy]
        if sampled:
            parts.append(logprobs[sampled])
        for k in _counts(wanted):
            top = torch.topk(logprobs[[i for i, r in enumerate(order) if wanted[r].logprobs == k]], k, dim=-1)
            parts += [top.values, top.indices]
        return parts

    def fill(self, tok: SampledToken, row: int, greedy_token: int) -> SampledToken:
        whole = self._rows.get(row)
        if whole is not None:
            tok.logprob = float(whole[tok.token_id])
        else:
            assert tok.token_id == greedy_token  # (a greedy row's token is its argmax)
            tok.logprob = self._greedy[row]
        if row in self._top:
            tok.top_token_ids, tok.top_logprobs = self._top[row]
        return tok


def _counts(wanted: dict[int, SamplingParams]) -> list[int]:
    """The distinct top-logprob counts asked (0: the sampled token's alone)."""
    return sorted({p.logprobs for p in wanted.values() if p.logprobs})
