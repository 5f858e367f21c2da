"""A scheduler's requests through a broken pipeline: kept as if preempted (generated tokens kept, their KV
gone with the epoch) until the scheduler of the next epoch takes them over (docs/recovery.md)."""
from __future__ import annotations

from collections import deque

from scheduler.block_manager import BlockManager
from scheduler.kv_transfer import KVTransfers
from scheduler.request import Request, RequestOutput, Status


def requeue_all(s) -> list[Request]:
    """Every request of scheduler `s` back to waiting, running ones first, until a scheduler of the next epoch
    takes them over (take_over) or they fail (fail_all). Returns them."""
    for r in s.running:  # (a waiting one lost no work)
        r.num_recoveries += 1
    requests = s.policy.order([*s.running, *s.waiting, *s.transfers.pending()])
    s.transfers = KVTransfers(s.config.kv_hold_timeout_s)  # held KV and pulls end with the cache
    for r in requests:
        r.status, r.seq_id = Status.WAITING, -1
        r.num_computed_tokens = r.in_flight = r.num_output_placeholders = 0
        r.kv_source, r.kv_ready = None, False  # its prompt is computed again here
    s.running, s.waiting = [], deque(requests)
    s._finished_seq_ids = []
    s.kv = BlockManager(s.config.num_kv_blocks, s.config.block_size, s.config.enable_prefix_caching)
    return requests


def take_over(s, old) -> list[RequestOutput]:
    """`s` adopts the requests `old` kept (after its requeue_all), in their order; those that no longer fit this
    epoch's context length or KV cache fail (their outputs are returned)."""
    assert not old.running, "take_over needs the old scheduler's requests requeued"
    failed = []
    for request in old.waiting:
        total = len(request.prompt_token_ids) + request.sampling.max_tokens
        if total > s.config.max_model_len or s.kv.blocks_needed(total) > s.config.num_kv_blocks:
            request.status = Status.FINISHED
            failed.append(RequestOutput(
                request.request_id, finish_reason="error", num_prompt_tokens=len(request.prompt_token_ids),
                error=f"the pipeline re-formed with room for {s.config.max_model_len} tokens per request and a "
                      f"KV cache of {s.config.kv_cache_tokens}; this request needs {total}"))
            continue
        s.requests[request.request_id] = request
        s.policy.enqueue(s.waiting, request)
    old.requests, old.waiting = {}, deque()
    return failed
