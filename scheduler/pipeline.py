"""What a replica's driver talks to: the pipeline of stages that computes its steps.

The driver (scheduler.driver) schedules steps and routes their outputs to the
requests; a Pipeline carries a step through every stage and brings back what
the last stage sampled. Two implementations: the stage services over gRPC
(scheduler.grpc_pipeline), where stages register, join an epoch and are
probed, and stage slices in this process (stagemesh.entry.inprocess_pipeline), which
`LocalEngine`, `stagemesh generate` and the driver's unit tests use.

The driver checks what comes back against the step it sent (check_result), so
a stage that answers nonsense is a failed stage, never a wrong token.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Awaitable, Protocol

from opentelemetry import trace

from scheduler.rendezvous import PipelinePlan, StageInfo
from stagemesh.core.sampling_params import StructuredOutputs
from stagemesh.core.errors import StagemeshError
from stagemesh.core.speculative import MAX_NUM_SPECULATIVE_TOKENS
from stagemesh.core.step import PromptLogprobs, SampledToken, StepBatch


@dataclass
class StepResult:
    """A step's result: the last stage's sampled tokens (in chunk order: one per sampling chunk, or
    1..N+1 consecutive ones for a chunk with N drafts), prompt logprobs, the compute seconds of every
    stage together, and a draft model's proposals for the sequences' next steps."""
    sampled: list[SampledToken]
    prompt_logprobs: list[PromptLogprobs] = field(default_factory=list)
    compute_seconds: float = 0.0
    drafts: dict[int, list[int]] = field(default_factory=dict)


class StageFailure(Exception):
    """A stage did not answer, or answered nonsense: the epoch ends and every request in it fails."""

    def __init__(self, stage: StageInfo | str, detail: str, unreachable: bool = False, timed_out: bool = False):
        self.stage = stage.name if isinstance(stage, StageInfo) else stage
        self.unreachable = unreachable  # the stage itself did not answer (not: it answered that a peer failed)
        self.timed_out = timed_out  # the call's deadline passed (the stage may be slow, not gone)
        super().__init__(f"{self.stage} failed: {detail}")


class Pipeline(Protocol):
    block_size: int
    num_stages: int
    # whether the stages compute different steps at the same time (separate processes): the driver keeps
    # one micro-batch in flight per stage; otherwise one step runs at a time through all of them
    overlaps_stages: bool
    # disaggregated prefill: the key of the read tickets of the KV this replica holds (stagemesh.core.kv_ticket);
    # the stages get it at each join
    kv_read_key: bytes

    def layout(self) -> PipelinePlan | None:
        """The stages that would form the next epoch, or None while some are missing."""

    async def join(self, epoch: int, plan: PipelinePlan, max_model_len: int, max_num_batched_tokens: int) -> None:
        """Make `plan`'s stages one pipeline for `epoch`; raises StageFailure."""

    def forward(self, epoch: int, batch: StepBatch, span: trace.Span | None,
                trace_links: list[str]) -> Awaitable[StepResult]:
        """Start the step on every stage now; the awaitable gives its result or raises StageFailure."""

    async def probe(self) -> StageFailure | None:
        """Whether every stage of the pipeline still answers as the instance that joined."""

    async def compile_grammar(self, structured: StructuredOutputs, timeout_s: float) -> None:
        """Structured outputs: the last stage compiles a request's constraint and keeps it for the sequence (the
        scheduler does not schedule the request until then: vLLM's WAITING_FOR_FSM). Raises InvalidParameter for
        a constraint that does not compile, TimeoutError past timeout_s, StagemeshError when no stage answers."""

    async def pull_kv(self, epoch: int, pull, timeout_s: float) -> int:
        """Disaggregated prefill: every stage fetches its layers of a prompt's KV held on a prefill replica
        (pull: scheduler.kv_transfer.KVPull) into the pull's blocks, its reads bounded by timeout_s; the bytes
        moved. Raises when it cannot (after every stage's call ended: none writes into the blocks any more; the
        kv_load_failure_policy then decides): a pipeline without stage services always does."""

    async def store_kv(self, epoch: int, block_ids: list[int], host_slots: list[int], hashes: list[int],
                       to_disk: list[bool], disk_evictions: list[int]) -> None:
        """KV tiers: every stage copies these pool blocks into its host tier, and on to disk, and deletes the
        evicted disk blocks (scheduler.tiers.StoreJob). Raises when a stage could not."""

    async def load_kv(self, epoch: int, block_ids: list[int], host_slots: list[int], hashes: list[int]
                      ) -> list[bool]:
        """KV tiers: every stage fills these pool blocks from its host or disk tier (scheduler.tiers.LoadJob);
        per block, whether every stage did."""

    async def release_kv(self, source, timeout_s: float | None = None) -> bool | None:
        """Tell the prefill replica of `source` (KVSourceInfo) to free the blocks it held: whether it held them
        (None: it did not answer within timeout_s; errors are logged)."""


def check_result(batch: StepBatch, result: StepResult, vocab_size: int | None,
                 all_failed_is_fault: bool = True) -> None:
    """Raises StagemeshError unless `result` answers `batch`: tokens for each sampling chunk, in order, in
    the vocabulary (with drafts: the accepted ones equal to the drafts, at most one more); prompt logprobs
    only within the chunks the step computed; proposals only for sequences that sampled. With
    `all_failed_is_fault`, a step whose every sequence (more than one) failed to sample is the model failing."""
    c = batch.chunks
    vocab = vocab_size or (1 << 31)
    if _plain_answer(batch, result, vocab, all_failed_is_fault):
        return
    drafts = {seq_id: (c.token_ids[end - d:end] if d else [])
              for seq_id, sample, d, end in zip(c.seq_ids, c.sample, c.draft_counts(), _ends(c.num_tokens)) if sample}
    runs = token_runs(result.sampled)
    got = [seq_id for seq_id, _ in runs]
    if got != list(drafts):
        raise StagemeshError(f"the stage sampled sequences {got[:8]}, the step asked for {list(drafts)[:8]}")
    for seq_id, tokens in runs:
        draft = drafts[seq_id]
        ids = [t.token_id for t in tokens]
        if len(tokens) > len(draft) + 1 or ids[:-1] != draft[:len(ids) - 1] or \
                any(t.error is not None for t in tokens[:-1]):
            raise StagemeshError(f"the stage's tokens for sequence {seq_id} do not follow its drafts")
    if any(not 0 <= t.token_id < vocab for t in result.sampled if t.error is None):
        raise StagemeshError(f"the stage sampled a token id outside the vocabulary of {vocab}")
    errors = [tokens[-1].error for _, tokens in runs if tokens[-1].error is not None]
    if all_failed_is_fault and len(errors) == len(runs) > 1:  # not one request's data: the model itself is failing
        raise StagemeshError(f"every one of the {len(runs)} sequences of the step failed to sample ({errors[0]})")
    for seq_id, proposed in result.drafts.items():
        if seq_id not in drafts or len(proposed) > MAX_NUM_SPECULATIVE_TOKENS or \
                any(not 0 <= t < vocab for t in proposed):
            raise StagemeshError(f"the stage proposed drafts for sequence {seq_id} that the step cannot take")
    if result.prompt_logprobs:
        spans = {seq_id: (start, start + n) for seq_id, start, n in zip(c.seq_ids, c.start_positions, c.num_tokens)}
        for p in result.prompt_logprobs:
            lo, hi = spans.get(p.seq_id, (0, -1))
            if not lo < p.start <= hi or p.start + len(p.entries) - 1 > hi or \
                    any(not 0 <= e.token_id < vocab for e in p.entries):
                raise StagemeshError(f"the stage scored prompt tokens outside sequence {p.seq_id}'s chunk")


def _plain_answer(batch: StepBatch, result: StepResult, vocab: int, all_failed_is_fault: bool) -> bool:
    """check_result's common case, checked in one pass: no drafts either way, one token per sampling chunk, in
    order, in the vocabulary, not every row failed. False: the general check decides (and names the fault)."""
    c = batch.chunks
    if any(c.num_draft_tokens) or result.drafts:
        return False
    sampled = result.sampled
    if [t.seq_id for t in sampled] != [seq_id for seq_id, sample in zip(c.seq_ids, c.sample) if sample]:
        return False
    failed = 0
    for t in sampled:
        if t.error is not None:
            failed += 1
        elif not 0 <= t.token_id < vocab:
            return False
    return not (all_failed_is_fault and failed == len(sampled) > 1)


def token_runs(sampled: list[SampledToken]) -> list[tuple[int, list[SampledToken]]]:
    """The sampled tokens grouped by sequence (each sequence's are consecutive), in order."""
    runs: list[tuple[int, list[SampledToken]]] = []
    for t in sampled:
        if runs and runs[-1][0] == t.seq_id:
            runs[-1][1].append(t)
        else:
            runs.append((t.seq_id, [t]))
    return runs


def _ends(num_tokens: list[int]) -> list[int]:
    out, at = [], 0
    for n in num_tokens:
        at += n
        out.append(at)
    return out
