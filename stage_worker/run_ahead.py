"""Steps scheduled ahead of their sequences' last tokens (async scheduling), on the stage side.

The scheduler may send a sequence's next step before the step in flight has
sampled its token (scheduler.request.Request.num_output_placeholders counts
them); that chunk ends in PLACEHOLDER, which the first stage replaces with
the sampled token before it embeds the chunk. The last stage knows the token
once it has run the step before. With one stage, it fills the step itself.
With several, the last stage sends the tokens back to the first over the
handoff the stages share (a send on the epoch's world with the nccl handoff,
a PushActivations call carrying sampled_tokens with the grpc one) as soon as
it has run the step before, ahead of waiting for the step's activations,
which the first stage computes only once it has the tokens.
"""
from __future__ import annotations

import logging

from stagemesh.core.errors import StagemeshError
from stagemesh.core.step import PLACEHOLDER, StepBatch
from stage_worker.sampler import Sampler

log = logging.getLogger("stagemesh.stage")


def has_placeholders(batch: StepBatch) -> bool:
    return PLACEHOLDER in batch.chunks.token_ids


def sampled_tokens(sampler: Sampler | None, batch: StepBatch) -> list[int]:
    """On the last stage (TP rank 0): the tokens the step's placeholders stand for, in their order (each
    sequence's last sample)."""
    if sampler is None:
        raise StagemeshError("only the last stage's TP rank 0 knows the sampled tokens a step ahead needs")
    out = []
    for _, seq_id in batch.chunks.placeholders():
        state = sampler.seqs.get(seq_id)
        if state is None or not state.output:
            raise StagemeshError(f"sequence {seq_id} has no sampled token to fill a step ahead with")
        out.append(state.output[-1])
    return out


def fill(batch: StepBatch, tokens: list[int]) -> None:
    """Put `tokens` where the step has PLACEHOLDER, in order."""
    found = batch.chunks.placeholders()
    if len(found) != len(tokens):
        raise StagemeshError(f"step {batch.step_id} has {len(found)} tokens scheduled ahead, got {len(tokens)}")
    for (index, _), token in zip(found, tokens):
        batch.chunks.token_ids[index] = token


class RunAhead:
    """A stage's part in the steps run ahead of one epoch: the last stage of several publishes the tokens,
    the first fills them in."""

    def __init__(self, runner, handoff, epoch: int):
        self.runner, self.handoff, self.epoch = runner, handoff, epoch
        self._told = False

    def publish(self, batch: StepBatch) -> None:
        """Last stage of several: send the first stage the tokens `batch` needs (the step before has run)."""
        self.handoff.send_tokens(batch.step_id, sampled_tokens(self.runner.sampler, batch))

    def fill(self, batch: StepBatch) -> list[int]:
        """First stage: the tokens from this stage's own samples (one stage) or from the last stage's; returns
        them (the TP followers fill theirs with the same)."""
        if self.runner.is_last_stage:
            tokens = sampled_tokens(self.runner.sampler, batch)
        else:
            if not self._told:
                self._told = True
                log.info("steps scheduled ahead take their sampled tokens from the last stage (epoch %d)",
                         self.epoch)
            tokens = self.handoff.recv_tokens(batch.step_id, len(batch.chunks.placeholders()))
        fill(batch, tokens)
        return tokens
