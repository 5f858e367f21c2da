"""StepBatch and SampledToken <-> protobuf: the scheduler encodes, stages decode."""
from __future__ import annotations

from stagemesh.step import NewSequence, SampledToken, ScheduledChunk, StepBatch
from stagemesh.v1 import common_pb2, stage_pb2
from stagemesh.wire import sampling_from_pb, sampling_to_pb


def step_to_pb(batch: StepBatch) -> stage_pb2.StepBatch:
    return stage_pb2.StepBatch(
        step_id=batch.step_id, micro_batch=batch.micro_batch,
        new_sequences=[stage_pb2.NewSequence(seq_id=s.seq_id, prompt_token_ids=s.prompt_token_ids,
                                             sampling=sampling_to_pb(s.sampling), output_token_ids=s.output_token_ids)
                       for s in batch.new_sequences],
        chunks=[stage_pb2.ScheduledChunk(seq_id=c.seq_id, token_ids=c.token_ids, start_position=c.start_position,
                                         new_block_ids=c.new_block_ids, sample=c.sample) for c in batch.chunks],
        finished_seq_ids=batch.finished_seq_ids,
    )


def step_from_pb(msg: stage_pb2.StepBatch) -> StepBatch:
    return StepBatch(
        step_id=msg.step_id, micro_batch=msg.micro_batch,
        new_sequences=[NewSequence(s.seq_id, list(s.prompt_token_ids), sampling_from_pb(s.sampling),
                                   list(s.output_token_ids)) for s in msg.new_sequences],
        chunks=[ScheduledChunk(c.seq_id, list(c.token_ids), c.start_position, list(c.new_block_ids), c.sample)
                for c in msg.chunks],
        finished_seq_ids=list(msg.finished_seq_ids),
    )


def sampled_to_pb(tok: SampledToken) -> stage_pb2.SampledToken:
    return stage_pb2.SampledToken(
        seq_id=tok.seq_id, has_logprob=tok.logprob is not None,
        token=common_pb2.TokenLogprob(token_id=tok.token_id, logprob=tok.logprob or 0.0,
                                      top_token_ids=tok.top_token_ids, top_logprobs=tok.top_logprobs))


def sampled_from_pb(msg: stage_pb2.SampledToken) -> SampledToken:
    t = msg.token
    return SampledToken(msg.seq_id, t.token_id, t.logprob if msg.has_logprob else None,
                        list(t.top_token_ids), list(t.top_logprobs))
