"""What a replica's driver talks to: the pipeline of stages that computes its steps.

The driver (scheduler.driver) schedules steps and routes their outputs to the
requests; a Pipeline carries a step through every stage and brings back what
the last stage sampled. Two implementations: the stage services over gRPC
(scheduler.grpc_pipeline), where stages register, join an epoch and are
probed, and stage slices in this process (scheduler.inprocess_pipeline), which
`LocalEngine`, `stagemesh generate` and the driver's unit tests use.

The driver checks what comes back against the step it sent (check_result), so
a stage that answers nonsense is a failed stage, never a wrong token.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Awaitable, Protocol

from opentelemetry import trace

from scheduler.rendezvous import PipelinePlan, StageInfo
from stagemesh.core.errors import StagemeshError
from stagemesh.core.step import PromptLogprobs, SampledToken, StepBatch


@dataclass
class StepResult:
    """A step's result: the last stage's sampled tokens (one per sampling chunk, in order), prompt
    logprobs, and the compute seconds of every stage together."""
    sampled: list[SampledToken]
    prompt_logprobs: list[PromptLogprobs] = field(default_factory=list)
    compute_seconds: float = 0.0


class StageFailure(Exception):
    """A stage did not answer, or answered nonsense: the epoch ends and every request in it fails."""

    def __init__(self, stage: StageInfo | str, detail: str):
        self.stage = stage.name if isinstance(stage, StageInfo) else stage
        super().__init__(f"{self.stage} failed: {detail}")


class Pipeline(Protocol):
    block_size: int
    num_stages: int
    # whether the stages compute different steps at the same time (separate processes): the driver keeps
    # one micro-batch in flight per stage; otherwise one step runs at a time through all of them
    overlaps_stages: bool

    def layout(self) -> PipelinePlan | None:
        """The stages that would form the next epoch, or None while some are missing."""

    async def join(self, epoch: int, plan: PipelinePlan, max_model_len: int, max_num_batched_tokens: int) -> None:
        """Make `plan`'s stages one pipeline for `epoch`; raises StageFailure."""

    def forward(self, epoch: int, batch: StepBatch, span: trace.Span | None,
                trace_links: list[str]) -> Awaitable[StepResult]:
        """Start the step on every stage now; the awaitable gives its result or raises StageFailure."""

    async def probe(self) -> StageFailure | None:
        """Whether every stage of the pipeline still answers as the instance that joined."""

    async def pull_kv(self, epoch: int, pull) -> int:
        """Disaggregated prefill: every stage fetches its layers of a prompt's KV held on a prefill replica
        (pull: scheduler.kv_transfer.KVPull) into the pull's blocks; the bytes moved. Raises when it cannot
        (the request then computes its prompt): a pipeline without stage services always does."""

    async def release_kv(self, source) -> None:
        """Tell the prefill replica of `source` (KVSourceInfo) to free the blocks it held; errors are logged."""


def check_result(batch: StepBatch, result: StepResult, vocab_size: int | None) -> None:
    """Raises StagemeshError unless `result` answers `batch`: a token for each sampling chunk, in order, in
    the vocabulary; prompt logprobs only within the chunks the step computed."""
    c = batch.chunks
    want = [seq_id for seq_id, sample in zip(c.seq_ids, c.sample) if sample]
    got = [t.seq_id for t in result.sampled]
    if got != want:
        raise StagemeshError(f"the stage sampled sequences {got[:8]}, the step asked for {want[:8]}")
    vocab = vocab_size or (1 << 31)
    if any(not 0 <= t.token_id < vocab for t in result.sampled if t.error is None):
        raise StagemeshError(f"the stage sampled a token id outside the vocabulary of {vocab}")
    errors = [t.error for t in result.sampled if t.error is not None]
    if len(errors) == len(want) > 1:  # not one request's data: the model itself is failing
        raise StagemeshError(f"every one of the {len(want)} sequences of the step failed to sample ({errors[0]})")
    if result.prompt_logprobs:
        spans = {seq_id: (start, start + n) for seq_id, start, n in zip(c.seq_ids, c.start_positions, c.num_tokens)}
        for p in result.prompt_logprobs:
            lo, hi = spans.get(p.seq_id, (0, -1))
            if not lo < p.start <= hi or p.start + len(p.entries) - 1 > hi or \
                    any(not 0 <= e.token_id < vocab for e in p.entries):
                raise StagemeshError(f"the stage scored prompt tokens outside sequence {p.seq_id}'s chunk")
