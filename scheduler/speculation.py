"""Speculative decoding, the scheduler's part: which draft tokens a request's next step carries, and the
acceptance counts (vLLM's spec_decode metrics).

A running request keeps the drafts for its next step in Request.spec_token_ids: proposed here from its
tokens (ngram), or taken from the last step's result (a draft model on the last stage proposes them
after it verifies). A decode step carries its last token and the drafts as one chunk; the last stage
verifies them in that step and returns 1..k+1 tokens; Scheduler.update_from_output rolls the request's
num_computed_tokens back over the rejected ones. docs/speculative-decoding.md has the design.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from scheduler.ngram import NgramProposer
from scheduler.request import Request
from stagemesh.core.speculative import SpeculativeConfig


@dataclass
class SpecDecodeStats:
    """Cumulative counts, as vLLM's spec_decode counters: steps that carried drafts, drafts sent, drafts
    accepted, and accepted by position (accepted_per_pos[i]: the i-th draft of a step was accepted)."""
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)


class Speculator:
    def __init__(self, config: SpeculativeConfig, max_model_len: int):
        self.config = config
        self.k = config.num_speculative_tokens
        self.max_model_len = max_model_len
        self.ngram = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max) if config.is_ngram else None
        self.stats = SpecDecodeStats(accepted_per_pos=[0] * self.k)

    def lookahead(self, request: Request, num_tokens: int) -> int:
        """KV slots a sampling chunk needs past its own `num_tokens`: the draft model writes the KV of the
        tokens it feeds itself while it proposes the next step's drafts."""
        if not self.config.uses_draft_model:
            return num_tokens
        return min(num_tokens + self.k, self.max_model_len)

    def drafts(self, request: Request) -> list[int]:
        """The drafts the request's next decode step may carry: none past max_tokens (the step returns one
        token more than it verifies) or the context length."""
        room = min(request.sampling.max_tokens - len(request.output_token_ids),
                   self.max_model_len - request.num_tokens) - 1
        return request.spec_token_ids[:max(room, 0)]

    def propose(self, request: Request, drafts: list[int] | None) -> None:
        """After a step appended tokens: the request's drafts for its next step (ngram: from its tokens;
        draft model: those the last stage proposed, if any)."""
        if self.ngram is not None:
            request.spec_token_ids = self.ngram.propose(request.all_token_ids, self.k)
        else:
            request.spec_token_ids = list(drafts or ())[:self.k]

    def record(self, num_drafts: int, num_accepted: int) -> None:
        s = self.stats
        s.num_drafts += 1
        s.num_draft_tokens += num_drafts
        s.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            s.accepted_per_pos[i] += 1
