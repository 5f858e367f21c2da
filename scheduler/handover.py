"""A scheduler's requests handed on to another that goes on with them: from a broken epoch's scheduler to the next
epoch's (requeue_all, then take_over: docs/recovery.md), from the warm-up's scheduler to the first serving one
(continue_after: scheduler.warmup), and from a draining replica to another replica (migrate_all), or some of a
replica's running requests, for a router that rebalances (migrate_some)."""
from __future__ import annotations

import itertools

from scheduler.admission import request_tokens
from scheduler.kv_accounting import KVAccounting
from scheduler.kv_transfer import KVTransfers
from scheduler.request import HeldKV, Request, RequestOutput
from scheduler.scheduler import Scheduler, kv_pool
from scheduler.status import Status


def continue_after(s: Scheduler, warm: Scheduler) -> None:
    """`warm` ran steps in this epoch before `s` (scheduler.warmup): its step and sequence ids stay spent on the
    stages, and its finished sequences are dropped there with s's first step."""
    s.new_step_ids = itertools.count(next(warm.new_step_ids))
    s.new_seq_ids = itertools.count(next(warm.new_seq_ids))
    s.finished_seq_ids = [*warm.finished_seq_ids, *s.finished_seq_ids]


# -- a broken pipeline: the old epoch's scheduler requeues, the next one's takes over ---------------------------
def requeue_all(s: Scheduler) -> list[Request]:
    """Every request of `s` goes back to waiting, as if preempted (generated tokens kept, its KV gone with the
    epoch), running ones first, until a scheduler of the next epoch takes them over (take_over) or they fail
    (Scheduler.fail_all). Nothing a step in flight computed was streamed, so recomputing loses and repeats
    nothing (a seeded request draws by (seed, position); drafts are proposed again). Returns them."""
    for r in s.running:  # (a waiting one lost no work)
        r.num_recoveries += 1
    loading = s.kv.tiers.pending() if s.kv.tiers is not None else []
    requests = s.policy.order([*s.running, *s.waiting, *s.transfers.pending(), *loading])
    releases = s.transfers.take_releases()  # (the KV prefill replicas hold for requests gone: still released)
    s.transfers = KVTransfers(s.config.kv_hold_timeout_s)  # held KV and pulls end with the cache
    # a request whose prompt KV a prefill replica holds computes it again here: that KV may be freed
    releases += [r.kv_source for r in requests if r.kv_source is not None]
    for r in requests:
        r.restart()
    s.transfers.requeue_releases(releases)
    s.running, s.waiting = [], s.policy.waiting(requests)
    s.finished_seq_ids = []
    s.kv = kv_pool(s.config)
    s.accounting = KVAccounting(s.kv, s.transfers, s.spec)
    return requests


def take_over(s: Scheduler, old: Scheduler) -> list[RequestOutput]:
    """`s` adopts the requests `old` kept (after its requeue_all), in their order; those that no longer fit this
    epoch's context length or KV cache fail (their outputs are returned)."""
    assert not old.running, "take_over needs the old scheduler's requests requeued"
    failed, cfg = [], s.config
    for request in old.waiting:
        total = request_tokens(len(request.prompt_token_ids), request.sampling)
        if total > s.max_model_len or not cfg.fits_kv_cache(total):
            request.status = Status.FINISHED
            failed.append(RequestOutput(
                request.request_id, finish_reason="error", num_prompt_tokens=len(request.prompt_token_ids),
                error=f"the pipeline re-formed with room for {s.max_model_len} tokens per request "
                      f"and a KV cache of {cfg.kv_cache_tokens}; this request needs {total}"))
            continue
        s.requests[request.request_id] = request
        s.policy.arrived(request)
        s.waiting.add(request)
    old.requests, old.waiting = {}, old.policy.waiting()
    s.transfers.requeue_releases(old.transfers.take_releases())
    return failed


# -- a draining replica ---------------------------------------------------------------------------------------
MIN_TOKENS_LEFT = 32  # a rebalance moves no request that may end sooner (a move costs a KV transfer's pause)


def migrate_some(s: Scheduler, max_requests: int, with_kv: bool,
                 min_tokens_left: int = MIN_TOKENS_LEFT) -> list[RequestOutput]:
    """A router rebalances: up to `max_requests` running requests of `s` between two decode steps (not in
    flight, all their tokens but the last computed, min_tokens_left or more to go) end "migrated" as migrate_all
    ends them, those with the most tokens left first (a move pays for its pause over more of them); the replica
    goes on with the rest."""
    def left(r: Request) -> int:
        return r.sampling.max_tokens - len(r.output_token_ids)

    movable = [r for r in s.running if not r.in_flight and r.status is Status.RUNNING
               and r.num_computed_tokens == r.num_tokens - 1 and not r.num_output_placeholders
               and left(r) >= min_tokens_left]
    movable.sort(key=left, reverse=True)
    return [_migrated(s, r, with_kv) for r in movable[:max_requests]]


def migrate_all(s: Scheduler, with_kv: bool) -> list[RequestOutput]:
    """The replica drains: every request of `s` not in flight ends "migrated", for its router to go on with it
    on another replica. A running one whose tokens but the last are computed, with with_kv, keeps its KV blocks
    held here (RequestOutput.held_kv) until the replica that takes it has read them (ReleaseKV) or
    --kv-hold-timeout; the others go without (computed again there). Those in flight are left (their step's
    result first): the caller calls again."""
    return [_migrated(s, request, with_kv) for request in [*s.running, *s.waiting] if not request.in_flight]


def _migrated(s: Scheduler, request: Request, with_kv: bool) -> RequestOutput:
    """`request` ends "migrated", with its KV held (all but its last token's) where with_kv and it can."""
    n = request.num_computed_tokens
    movable = (with_kv and request.status is Status.RUNNING and n == request.num_tokens - 1
               and not request.num_output_placeholders and not s.kv.hybrid)  # (a table per group: not carried)
    table = s.kv.tables.get(request.request_id, [])[:s.kv.blocks_needed(n)] if movable else []
    out = s.finish(request, "migrated", hold_kv=movable)
    if movable:
        out.held_kv = HeldKV(list(table), n)
    return out
