"""A replica's requests kept through a broken pipeline (docs/recovery.md), the scheduler's part: the old
epoch's scheduler puts them all back in waiting, as if preempted, and the next epoch's adopts them.

Nothing a step in flight was computing was streamed, so recomputing prompt + generated tokens loses and
repeats nothing (a seeded request draws by (seed, position); drafts are proposed again).
"""
from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from scheduler.admission import fits_kv_cache
from scheduler.block_manager import BlockManager
from scheduler.kv_transfer import KVTransfers
from scheduler.request import Request, RequestOutput, Status

if TYPE_CHECKING:
    from scheduler.scheduler import Scheduler


def requeue_all(s: Scheduler) -> list[Request]:
    """Every request of `s` goes back to waiting (generated tokens kept, its KV gone with the epoch),
    running ones first, until a scheduler of the next epoch takes them over (take_over) or they fail
    (Scheduler.fail_all). Returns them."""
    for r in s.running:  # (a waiting one lost no work)
        r.num_recoveries += 1
    loading = s.kv.tiers.pending() if s.kv.tiers is not None else []
    requests = s.policy.order([*s.running, *s.waiting, *s.transfers.pending(), *loading])
    releases = s.transfers.take_releases()  # (the KV prefill replicas hold for requests gone: still released)
    s.transfers = KVTransfers(s.config.kv_hold_timeout_s)  # held KV and pulls end with the cache
    for r in requests:
        if r.kv_source is not None:  # its prompt is computed again: the prefill replica may free that KV
            releases.append(r.kv_source)
        r.status, r.seq_id = Status.WAITING, -1
        r.num_computed_tokens = r.in_flight = r.num_output_placeholders = 0
        r.spec_token_ids = []
        r.kv_source, r.kv_ready = None, False  # its prompt is computed again here
        r.tiers_checked = False
    s.transfers.requeue_releases(releases)
    s.running, s.waiting = [], deque(requests)
    s._finished_seq_ids = []
    s.kv = BlockManager(s.config.num_kv_blocks, s.config.block_size, s.config.enable_prefix_caching)
    return requests


def take_over(s: Scheduler, old: Scheduler) -> list[RequestOutput]:
    """`s` adopts the requests `old` kept (after its requeue_all), in their order; those that no longer fit
    this epoch's context length or KV cache fail (their outputs are returned)."""
    assert not old.running, "take_over needs the old scheduler's requests requeued"
    failed, cfg = [], s.config
    for request in old.waiting:
        total = len(request.prompt_token_ids) + request.sampling.max_tokens
        if total > s.max_model_len or not fits_kv_cache(cfg, total):
            request.status = Status.FINISHED
            failed.append(RequestOutput(
                request.request_id, finish_reason="error", num_prompt_tokens=len(request.prompt_token_ids),
                error=f"the pipeline re-formed with room for {s.max_model_len} tokens per request "
                      f"and a KV cache of {cfg.kv_cache_tokens}; this request needs {total}"))
            continue
        s.requests[request.request_id] = request
        s.policy.enqueue(s.waiting, request)
    old.requests, old.waiting = {}, deque()
    s.transfers.requeue_releases(old.transfers.take_releases())
    return failed
