"""Beam search (use_beam_search), as vLLM runs it: above the engine, one token at a time. Each step sends every
running beam's tokens as a prompt asking one token with the top 2 x width logprobs (the model's own, before any
processing); each beam grows by each of those tokens, and the width best new beams by cumulative logprob over
length ** length_penalty (the prompt counted, as vLLM counts it) run on. A beam whose token is EOS is complete
(unless ignore_eos). After max_tokens steps, or when no beam runs, the width best of the complete and running
beams are the answer's choices, best first. The stages need nothing new: a step's prompts share the prefix
cache's blocks of their beam's earlier tokens on the replica that computed them, so a step computes little more
than each beam's last block.

early_stopping: false (the default, vLLM's) runs until max_tokens or until no beam runs; true stops once width
beams are complete (transformers' early_stopping=True).
"""
from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from stagemesh.core.step import TokenLogprob

# a step: for each prefix (prompt + a beam's tokens), the top candidates' (token id, logprob), most likely first
StepFn = Callable[[list[list[int]]], Awaitable[list[list[tuple[int, float]]]]]
MAX_WIDTH = 10  # 2 x width logprobs a step: vLLM's max_logprobs (20) bounds them as it bounds ours


@dataclass(frozen=True)
class BeamOptions:
    """A request's beam search switches (vLLM's fields); its width is the request's n."""
    length_penalty: float = 1.0
    early_stopping: bool = False


@dataclass(frozen=True)
class BeamParams:
    width: int
    max_tokens: int
    eos_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    length_penalty: float = 1.0
    early_stopping: bool = False
    include_stop_str_in_output: bool = False  # a complete beam keeps its EOS token
    max_model_len: int = 1 << 30


@dataclass
class Beam:
    tokens: list[int]  # the prompt and the beam's tokens
    num_prompt_tokens: int
    cum_logprob: float = 0.0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" (EOS) or "length" once it is an answer
    stop_reason: int | None = None

    @property
    def output_token_ids(self) -> list[int]:
        return self.tokens[self.num_prompt_tokens:]


def beam_score(beam: Beam, eos_token_ids: tuple[int, ...], length_penalty: float) -> float:
    """vLLM's get_beam_search_score: the cumulative logprob over the length (prompt included, an EOS at the end
    not) to the power length_penalty."""
    length = len(beam.tokens) - (1 if beam.tokens and beam.tokens[-1] in eos_token_ids else 0)
    return beam.cum_logprob / (length ** length_penalty)


async def search(prompt: list[int], p: BeamParams, step: StepFn) -> list[Beam]:
    """The width best beams of `prompt`, best first."""
    def key(b: Beam) -> float:
        return beam_score(b, p.eos_token_ids, p.length_penalty)

    running = [Beam(list(prompt), len(prompt))]
    complete: list[Beam] = []
    for _ in range(p.max_tokens):
        candidates = await step([b.tokens for b in running])
        grown: list[Beam] = []
        for beam, tops in zip(running, candidates):
            for token, logprob in tops[:2 * p.width]:
                child = _grow(beam, token, logprob, tops)
                if token in p.eos_token_ids and not p.ignore_eos:
                    if not p.include_stop_str_in_output:
                        child.tokens.pop()
                    child.finish_reason, child.stop_reason = "stop", token
                    complete.append(child)
                else:
                    grown.append(child)
        running = sorted(grown, key=key, reverse=True)[:p.width]
        for beam in running:  # a beam that fills the context is an answer of length
            if len(beam.tokens) >= p.max_model_len:
                beam.finish_reason = "length"
                complete.append(beam)
        running = [b for b in running if b.finish_reason is None]
        if not running or (p.early_stopping and len(complete) >= p.width):
            break
    for beam in running:
        beam.finish_reason = "length"
    return sorted(complete + running, key=key, reverse=True)[:p.width]


def _grow(beam: Beam, token: int, logprob: float, tops: list[tuple[int, float]]) -> Beam:
    rank = next((i + 1 for i, (t, _) in enumerate(tops) if t == token), 0)
    entry = TokenLogprob(token, logprob, rank, [t for t, _ in tops], [lp for _, lp in tops])
    return Beam(beam.tokens + [token], beam.num_prompt_tokens, beam.cum_logprob + logprob, beam.logprobs + [entry])

