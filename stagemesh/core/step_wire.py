"""StepBatch and sampled tokens <-> protobuf: the scheduler encodes steps, stages decode them, and back.

Chunks and sampled tokens travel as packed columns, so a step costs a few
list copies however many sequences it holds; only new sequences and logprobs
are messages per item.
"""
from __future__ import annotations

from collections.abc import Sequence

from stagemesh.core.step import (EpochSpec, NewSequence, PromptLogprobs, SampledToken, ScheduledChunks, StepBatch,
                            TokenLogprob)
from stagemesh.v1 import common_pb2, stage_pb2
from stagemesh.core.wire import sampling_from_pb, sampling_to_pb


def step_to_pb(batch: StepBatch, out: stage_pb2.StepBatch | None = None) -> stage_pb2.StepBatch:
    """The step as a message, written into `out` (the empty step of the request it travels in) where given:
    built in place, its new sequences' sampling parameters are not copied from message to message."""
    msg = stage_pb2.StepBatch() if out is None else out
    msg.step_id = batch.step_id
    for s in batch.new_sequences:
        new = msg.new_sequences.add(seq_id=s.seq_id, prompt_token_ids=s.prompt_token_ids,
                                    output_token_ids=s.output_token_ids, lora_name=s.lora_name)
        sampling_to_pb(s.sampling, new.sampling)
    c, chunks = batch.chunks, msg.chunks
    chunks.SetInParent()  # present even when empty: the bytes of a message built whole
    chunks.seq_ids.extend(c.seq_ids)
    chunks.num_tokens.extend(c.num_tokens)
    chunks.token_ids.extend(c.token_ids)
    chunks.start_positions.extend(c.start_positions)
    chunks.num_new_blocks.extend(c.num_new_blocks)
    chunks.new_block_ids.extend(c.new_block_ids)
    chunks.sample.extend(c.sample)
    chunks.num_draft_tokens.extend(c.num_draft_tokens)
    msg.finished_seq_ids.extend(batch.finished_seq_ids)
    msg.warmup = batch.warmup
    return msg


def step_from_pb(msg: stage_pb2.StepBatch) -> StepBatch:
    c = msg.chunks
    return StepBatch(
        step_id=msg.step_id,
        new_sequences=[NewSequence(s.seq_id, list(s.prompt_token_ids), sampling_from_pb(s.sampling),
                                   list(s.output_token_ids), s.lora_name) for s in msg.new_sequences],
        chunks=ScheduledChunks(list(c.seq_ids), list(c.num_tokens), list(c.token_ids), list(c.start_positions),
                               list(c.num_new_blocks), list(c.new_block_ids), list(c.sample),
                               list(c.num_draft_tokens)),
        finished_seq_ids=list(msg.finished_seq_ids),
        warmup=msg.warmup,
    )


def sampled_to_pb(sampled: list[SampledToken], prompt_logprobs: Sequence[PromptLogprobs] = (),
                  drafts: dict[int, list[int]] | None = None) -> stage_pb2.SampledTokens:
    """One row per sampled token (a sequence that verified drafts has several, consecutive); `drafts`: a draft
    model's proposals for the sequences' next steps."""
    msg = stage_pb2.SampledTokens(seq_ids=[t.seq_id for t in sampled], token_ids=[t.token_id for t in sampled])
    for seq_id, tokens in (drafts or {}).items():
        msg.draft_seq_ids.append(seq_id)
        msg.num_draft_tokens.append(len(tokens))
        msg.draft_token_ids.extend(tokens)
    for p in prompt_logprobs:
        msg.prompt_logprobs.add(seq_id=p.seq_id, start=p.start, logprobs=[logprob_to_pb(e) for e in p.entries])
    for row, t in enumerate(sampled):
        if t.error is not None:
            msg.error_rows.append(row)
            msg.errors.append(t.error)
        elif t.logprob is not None:
            msg.logprob_rows.append(row)
            msg.logprobs.append(common_pb2.TokenLogprob(token_id=t.token_id, logprob=t.logprob,
                                                        top_token_ids=t.top_token_ids, top_logprobs=t.top_logprobs))
    return msg


def logprob_to_pb(e: TokenLogprob) -> common_pb2.TokenLogprob:
    return common_pb2.TokenLogprob(token_id=e.token_id, logprob=e.logprob, rank=e.rank, top_token_ids=e.top_token_ids,
                                   top_logprobs=e.top_logprobs)


def logprob_from_pb(m: common_pb2.TokenLogprob) -> TokenLogprob:
    return TokenLogprob(m.token_id, m.logprob, m.rank, list(m.top_token_ids), list(m.top_logprobs))


def prompt_logprobs_from_pb(msg: stage_pb2.SampledTokens) -> list[PromptLogprobs]:
    return [PromptLogprobs(p.seq_id, p.start, [logprob_from_pb(e) for e in p.logprobs]) for p in msg.prompt_logprobs]


def drafts_from_pb(msg: stage_pb2.SampledTokens) -> dict[int, list[int]]:
    """The draft model's proposals (the caller checked that the columns line up)."""
    drafts, at = {}, 0
    for seq_id, n in zip(msg.draft_seq_ids, msg.num_draft_tokens):
        drafts[seq_id] = list(msg.draft_token_ids[at:at + n])
        at += n
    return drafts


def sampled_from_pb(msg: stage_pb2.SampledTokens) -> list[SampledToken]:
    sampled = list(map(SampledToken, msg.seq_ids, msg.token_ids))
    for row, lp in zip(msg.logprob_rows, msg.logprobs):
        t = sampled[row]
        t.logprob, t.top_token_ids, t.top_logprobs = lp.logprob, list(lp.top_token_ids), list(lp.top_logprobs)
    for row, error in zip(msg.error_rows, msg.errors):
        sampled[row].error = error or "sampling failed"
    return sampled


def epoch_to_pb(spec: EpochSpec) -> stage_pb2.JoinPipelineRequest:
    return stage_pb2.JoinPipelineRequest(
        epoch=spec.epoch, store_host=spec.store_host, store_port=spec.store_port, world_size=spec.world_size,
        rank_offset=spec.rank_offset, tp_sizes=spec.tp_sizes, num_kv_blocks=spec.num_kv_blocks,
        max_model_len=spec.max_model_len, max_num_batched_tokens=spec.max_num_batched_tokens,
        next_stage_address=spec.next_stage_address, first_stage_address=spec.first_stage_address,
        num_host_kv_blocks=spec.num_host_kv_blocks, kv_read_key=spec.kv_read_key)


def epoch_from_pb(msg: stage_pb2.JoinPipelineRequest) -> EpochSpec:
    return EpochSpec(msg.epoch, msg.store_host, msg.store_port, msg.world_size, msg.rank_offset, tuple(msg.tp_sizes),
                     msg.num_kv_blocks, msg.max_model_len, msg.max_num_batched_tokens, msg.next_stage_address,
                     msg.first_stage_address, msg.num_host_kv_blocks, msg.kv_read_key)
