"""The scheduler's replies on the wire: a request's outputs and refusals as SubmitStream updates, the status of
each refusal, and KV events as messages of bounded size (the servicer, scheduler.service, sends them)."""
from __future__ import annotations

import grpc

from scheduler.connection import Rejected, Update
from scheduler.driver import Unavailable
from scheduler.kv_events import AllBlocksCleared, BlockStored, KVEventBatch
from scheduler.kv_transfer import KVLoadFailed
from scheduler.request import RequestOutput
from scheduler.scheduler import QueueFull
from scheduler.sessions import NotHeld, Taken
from stagemesh.core.errors import StagemeshError
from stagemesh.core.grpc_errors import by_type
from stagemesh.core.step_wire import logprob_to_pb
from stagemesh.core.wire import kv_source_to_pb, pooled_to_pb
from stagemesh.v1 import scheduler_pb2

FINISH = {"stop": scheduler_pb2.FINISH_REASON_STOP, "length": scheduler_pb2.FINISH_REASON_LENGTH,
          "abort": scheduler_pb2.FINISH_REASON_ABORT, "prefilled": scheduler_pb2.FINISH_REASON_PREFILLED,
          "migrated": scheduler_pb2.FINISH_REASON_MIGRATED}
# hashes and token ids in one KV event message (a hash takes up to 10 bytes on the wire, a token id up to 5):
# at most 2 MiB, under the 4 MiB a gRPC client takes by default
MAX_KV_ITEMS_PER_MESSAGE = 200_000

# the status a request refused with one of these gets in its SubmitStream update, and a call that raises it;
# anything else a call raises is INTERNAL, logged
status_of = by_type((QueueFull, grpc.StatusCode.RESOURCE_EXHAUSTED), (Unavailable, grpc.StatusCode.UNAVAILABLE),
                    (KVLoadFailed, grpc.StatusCode.FAILED_PRECONDITION),
                    (NotHeld, grpc.StatusCode.NOT_FOUND), (Taken, grpc.StatusCode.ABORTED),
                    (StagemeshError, grpc.StatusCode.INVALID_ARGUMENT))


def error_status(out: RequestOutput) -> tuple[grpc.StatusCode, str]:
    """A request that failed in the pipeline: INVALID_ARGUMENT when its own data failed it (never retried
    elsewhere), UNAVAILABLE when the pipeline broke under it."""
    if out.own_fault:
        return grpc.StatusCode.INVALID_ARGUMENT, out.error or "the request failed"
    if out.kv_load_failed:  # its prompt's KV could not be loaded (kv_load_failure_policy fail): the router may
        return grpc.StatusCode.FAILED_PRECONDITION, out.error or "its prompt's KV could not be loaded"  # prefill again
    return grpc.StatusCode.UNAVAILABLE, out.error or "the pipeline failed"


def fill_output(reply: scheduler_pb2.SubmitResponse, out: RequestOutput, first: bool, kv_params) -> None:
    reply.token_ids.extend(out.new_token_ids)
    for t in out.new_logprobs:
        reply.logprobs.add(token_id=t.token_id, logprob=t.logprob, top_token_ids=t.top_token_ids,
                           top_logprobs=t.top_logprobs)
    if out.prompt_logprobs:
        reply.prompt_logprobs.extend(logprob_to_pb(e) for e in out.prompt_logprobs)
        reply.prompt_logprobs_start = out.prompt_logprobs_start
    if out.queue_seconds is not None:
        reply.queue_seconds = out.queue_seconds
    if first:
        reply.num_prompt_tokens, reply.num_cached_tokens = out.num_prompt_tokens, out.num_cached_tokens
    if out.finish_reason:
        reply.finish_reason = FINISH[out.finish_reason]
        if out.stop_token_id is not None:
            reply.stop_token_id = out.stop_token_id
        if out.held_kv is not None:
            kv_source_to_pb(kv_params(out), reply.kv_transfer)
    if out.pooled is not None:
        pooled_to_pb(out.pooled, reply.pooled)


def fill_update(msg: scheduler_pb2.RequestUpdate, update: Update, kv_params) -> None:
    item = update.item
    msg.request_id = item.request_id
    if isinstance(item, Rejected):
        code, message = status_of(item.error) or (grpc.StatusCode.INTERNAL, str(item.error))
    elif item.finish_reason == "error":  # its own data failed it, or the pipeline broke under it
        code, message = error_status(item)
    else:
        msg.output.SetInParent()
        fill_output(msg.output, item, update.first, kv_params)
        return
    msg.error.code, msg.error.message = code.value[0], message


def kv_batch_to_pbs(batch: KVEventBatch, block_size: int, limit: int = MAX_KV_ITEMS_PER_MESSAGE
                    ) -> list[scheduler_pb2.KVEventBatch]:
    """A batch as one message, or as several (a large snapshot) of at most `limit` hashes and token ids each, so
    that every message stays well under gRPC's 4 MiB: the same epoch, seq and snapshot on each, `more` on all
    but the last; an event split in two continues its chain (the second part's parent: the first's last)."""
    out = [scheduler_pb2.KVEventBatch()]
    room = limit
    for event in batch.events:
        if isinstance(event, AllBlocksCleared):
            out[-1].events.add().all_blocks_cleared.SetInParent()
            continue
        hashes = event.block_hashes
        tokens = event.token_ids if isinstance(event, BlockStored) else []
        per_block = 1 + (block_size if tokens else 0)
        i = 0
        while i < len(hashes):
            take = min(len(hashes) - i, room // per_block)
            if take == 0:
                out.append(scheduler_pb2.KVEventBatch())
                room = limit
                continue
            part = hashes[i:i + take]
            if isinstance(event, BlockStored):
                out[-1].events.add().block_stored.CopyFrom(scheduler_pb2.BlockStored(
                    block_hashes=part, parent_block_hash=event.parent_block_hash if i == 0 else hashes[i - 1],
                    token_ids=tokens[i * block_size:(i + take) * block_size], block_size=block_size,
                    medium=event.medium))
            else:
                out[-1].events.add().block_removed.CopyFrom(scheduler_pb2.BlockRemoved(block_hashes=part,
                                                                                       medium=event.medium))
            room -= take * per_block
            i += take
    for n, msg in enumerate(out):
        msg.ts, msg.epoch, msg.seq, msg.snapshot, msg.more = batch.ts, batch.epoch, batch.seq, batch.snapshot, \
            n < len(out) - 1
    return out
