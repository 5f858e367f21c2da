"""Sampling on the last stage: logits in, one token per sequence out (or, with draft tokens to verify,
the drafts accepted and one token more: speculative decoding).

The request's token controls, penalties and structured-output constraint (stage_worker.logits_processors,
stagemesh.core.grammar: the matcher advances here, with the token sampled), temperature, top-k /
top-p / min-p, per-request seeds and logprobs (of the model's distribution, before any processing).
A seeded request draws its n-th token from a generator seeded with (seed, n),
so its output does not depend on what else is in the batch.

A row that cannot be sampled (non-finite logits, a distribution with no mass)
fails alone: its SampledToken carries the error and the scheduler ends only that
request; the rest of the batch is sampled as usual.
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Callable

import torch

from stagemesh.core.errors import StagemeshError
from stagemesh.core.grammar import GrammarCompiler
from stagemesh.core.step import NewSequence, SampledToken, StepBatch
from stage_worker.logits_processors import SequenceState, needs_processing, process_row
from stage_worker.rejection import draw, rejection_sample
from stage_worker.step_on_host import Rows, StepOnHost

# a sequence's first sample waits this long for its grammar (the router refused those that take longer than
# its --grammar-compile-timeout, 5 s by default, to compile): past it the request fails alone
COMPILE_WAIT_S = 30.0


class Sampler:
    def __init__(self, device: str | torch.device = "cpu", eos_token_ids: tuple[int, ...] = (),
                 grammars: Callable[[], GrammarCompiler] | None = None):
        self.device = torch.device(device)
        self.eos_token_ids = tuple(eos_token_ids)  # min_tokens keeps them from being sampled early
        self.seqs: dict[int, SequenceState] = {}
        self._unseeded = torch.Generator(device="cpu").manual_seed(torch.initial_seed() % (2**63))
        self._grammars = grammars  # the stage's compiler, made on first use (it loads the tokenizer)
        self._compiler: GrammarCompiler | None = None  # ... once made (in the compile thread)
        self._compiles: ThreadPoolExecutor | None = None  # grammars compile here, beside the step's forward

    def warm(self) -> None:
        """Make the compiler (the tokenizer, its vocabulary indexed: a second or more) in the compile thread
        now, so that the first constrained sequence does not hold a step for it; a failure shows then."""
        if self._grammars is not None:
            self._thread().submit(self._made)

    def _made(self) -> GrammarCompiler:
        if self._grammars is None:
            raise StagemeshError("this stage cannot compile constraints")
        self._compiler = self._grammars()
        return self._compiler

    def prepare(self, structured) -> Future:
        """Compile a constraint into the compiler's cache, in the compile thread (the scheduler holds its request
        until this is done: vLLM's WAITING_FOR_FSM); the sequence that comes with it then finds it there."""
        return self._thread().submit(lambda: self._made().compile(structured))

    def _thread(self) -> ThreadPoolExecutor:
        if self._compiles is None:
            self._compiles = ThreadPoolExecutor(1, thread_name_prefix="grammar")
        return self._compiles

    def add_sequence(self, seq: NewSequence) -> None:
        state = SequenceState(seq.sampling, list(seq.prompt_token_ids), list(seq.output_token_ids))
        structured = seq.sampling.structured
        compiled = self._compiler.cached(structured) if structured is not None and self._compiler else None
        if compiled is not None:  # prepared (its scheduler waited for it): no wait behind another compile
            assert self._compiler is not None
            state.compiling = _done(self._compiler.matcher(compiled))
        elif structured is not None:
            # compiled off the step path (xgrammar lets go of the GIL): the forward that comes before the
            # sequence's first sample runs meanwhile (a stage that re-formed under a request has not seen it)
            state.compiling = self._thread().submit(self._compile, structured)
        self.seqs[seq.seq_id] = state

    def _compile(self, structured):
        compiler = self._made()
        return compiler.matcher(compiler.compile(structured))

    def _constrain(self, state: SequenceState) -> None:
        """The sequence's matcher once its grammar compiled (waited for at most COMPILE_WAIT_S), past the
        tokens it generated before a preemption; a constraint that cannot be followed fails the sequence's
        first sample (its request alone)."""
        compiling, state.compiling = state.compiling, None
        assert compiling is not None  # (called while it compiles)
        try:
            state.matcher = compiling.result(timeout=COMPILE_WAIT_S)
        except FutureTimeout:
            compiling.cancel()
            state.constraint_error = (f"the structured output constraint took more than {COMPILE_WAIT_S:g} s to "
                                      "compile on the last stage")
            return
        except (StagemeshError, ValueError, RuntimeError) as err:  # (InvalidParameter is a ValueError)
            state.constraint_error = f"the structured output constraint cannot be followed: {err}"
            return
        for token in state.output:
            if not state.matcher.accept(token):
                state.constraint_error = f"token {token} of the output so far does not fit the constraint"
                return

    def remove_sequence(self, seq_id: int) -> None:
        state = self.seqs.pop(seq_id, None)
        if state is not None and state.compiling is not None:
            state.compiling.cancel()

    def last_tokens(self, batch: StepBatch) -> list[int]:
        """The tokens a step run ahead's placeholders stand for, in their order: each sequence's last sample
        (async scheduling: the step was scheduled before the one before it had sampled)."""
        out = []
        for _, seq_id in batch.chunks.placeholders():
            state = self.seqs.get(seq_id)
            if state is None or not state.output:
                raise StagemeshError(f"sequence {seq_id} has no sampled token to fill a step ahead with")
            out.append(state.output[-1])
        return out

    def sample(self, logits: torch.Tensor, seq_ids: list[int], drafts: list[list[int]] | None = None,
               draft_probs: list[list[torch.Tensor] | None] | None = None) -> list[SampledToken]:
        """One token per sequence, from one row of logits each; or, for a sequence with N draft tokens
        (speculative decoding), N + 1 rows: the logits after its last token and after each draft. Those
        rows are verified in order: each is sampled as a row without drafts would be (processed with the
        drafts before it taken as output, a seeded draw by its position) and the draft is accepted while it
        equals the token drawn (rejection sampling with a one-hot draft distribution: the output's
        distribution, and a seeded request's tokens, are those without speculation). Where a draft model
        sampled the drafts, draft_probs holds its distribution of each: an unseeded sampled sequence's
        drafts are then kept or replaced by rejection sampling against it (stage_worker.rejection). Returns
        1..N+1 tokens per sequence, consecutive, in order.

        Everything the rows need from the device (greedy tokens, sampling distributions, logprobs) is
        computed there first and comes to the host in one copy (StepOnHost): one sync per step, not per row."""
        drafts = drafts or [[] for _ in seq_ids]
        draft_probs = draft_probs or [None] * len(seq_ids)
        states = [self.seqs[s] for s in seq_ids]
        for state in states:
            if state.compiling is not None:
                self._constrain(state)
        firsts = _first_rows(drafts)
        raw = logits.float()
        processed = [i for i, s in enumerate(states) if needs_processing(s.params)]
        logits = raw.clone() if processed else raw
        for i in processed:
            self._process_rows(logits, firsts[i], states[i], drafts[i])
        host = StepOnHost.gather(raw, logits, [Rows(firsts[i], s.params, drafts[i], draft_probs[i])
                                               for i, s in enumerate(states)])
        out = []
        for i, (seq_id, state, draft) in enumerate(zip(seq_ids, states, drafts)):
            for j in range(len(draft) + 1):
                row = firsts[i] + j
                error = state.constraint_error or host.error(row)
                token = None
                if error is None:
                    token, error = self._draw(host, row, state)
                if error is not None:
                    # a step run ahead may need this row's token: 0 stands in (its request ends here)
                    state.output.append(0)
                    out.append(SampledToken(seq_id, 0, error=error))
                    break
                assert token is not None  # (_draw gives a token or an error)
                state.output.append(token)
                out.append(host.with_logprobs(SampledToken(seq_id, token), state.params, row))
                if j == len(draft) or token != draft[j]:
                    break
        return out

    def _process_rows(self, logits: torch.Tensor, first: int, state: SequenceState, draft: list[int]) -> None:
        """The sequence's rows processed in place, row j as if drafts 0..j-1 were its output (they are when
        row j is used: a row after a rejected draft is never read); the matcher goes through the drafts to
        mask each row, then back."""
        base, advanced, matcher = len(state.output), 0, state.matcher
        try:
            for j in range(len(draft) + 1):
                process_row(logits[first + j], state, self.eos_token_ids)
                if j == len(draft):
                    break
                state.output.append(draft[j])
                if matcher is not None and not matcher.terminated:
                    if not matcher.accept(draft[j]):
                        break  # row j rules this draft out: it is rejected there
                    advanced += 1
        finally:
            del state.output[base:]
            if advanced:
                assert matcher is not None  # (it advanced)
                matcher.rollback(advanced)

    def _draw(self, host: StepOnHost, row: int, state: SequenceState) -> tuple[int | None, str | None]:
        """(the row's token, None) or (None, why it cannot be sampled); a constrained sequence's matcher
        advances past the token. A row with a draft model's distribution of its draft (an unseeded sampled
        sequence) keeps or replaces that draft by rejection sampling."""
        token = host.greedy_token(row)
        if not state.params.greedy:
            try:
                against = host.against(row)
                if against is not None:
                    token = rejection_sample(host.probs(row), against[1], against[0], self._unseeded)
                else:
                    token = draw(host.probs(row), self._generator(state))
            except (RuntimeError, ValueError) as err:  # this row's distribution only
                return None, f"sampling failed: {err}"
        if state.matcher is not None and not state.matcher.terminated and not state.matcher.accept(token):
            return None, f"sampled token {token} does not fit the constraint"
        return token, None

    def _generator(self, state: SequenceState) -> torch.Generator:
        """A seeded sequence draws its n-th token from a generator seeded with (seed, n); the others share one.
        (A distribution with no finite mass makes draw raise: that row fails alone, see sample.)"""
        p = state.params
        if p.seed is None:
            return self._unseeded
        return torch.Generator(device="cpu").manual_seed((p.seed * 1_000_003 + len(state.output)) % (2**63))


def _first_rows(drafts: list[list[int]]) -> list[int]:
    """Each sequence's first row of logits: one row, and one more per draft."""
    firsts, at = [], 0
    for d in drafts:
        firsts.append(at)
        at += len(d) + 1
    return firsts


def _done(value) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future
