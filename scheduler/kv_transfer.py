"""Disaggregated prefill in the scheduler's core (docs/disaggregated-prefill.md).

Prefill side: a prefill_only request ends once its prompt is computed and its first token sampled
("prefilled"); its KV blocks stay allocated, held for a decode replica until it releases them
(ReleaseKV) or the hold times out (--kv-hold-timeout). Decode side: a request whose prompt's KV is held
elsewhere (kv_source) gets blocks for its prompt, then waits while the driver pulls the KV into them
(every stage fetches its layers from the prefill replica's stages); once pulled it runs as if it had
computed its prompt here; if the pull fails it computes the prompt like any request. Nothing waits
forever: the pull has a deadline, the hold a timeout.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass

from scheduler.request import Request

log = logging.getLogger("stagemesh.scheduler")


@dataclass(frozen=True)
class KVSourceInfo:
    """Where a prompt's KV is held: the prefill replica's scheduler, its request, blocks and stages."""
    scheduler_address: str
    request_id: str
    epoch: int
    block_ids: tuple[int, ...]
    block_size: int
    num_tokens: int
    stages: tuple[tuple[str, int, int], ...]  # (address, layer start, layer end) per stage


@dataclass(frozen=True)
class KVPull:
    """A pull for the driver to run: the source's blocks into these blocks of this replica."""
    request_id: str
    block_ids: list[int]
    source: KVSourceInfo


class KVTransfers:
    def __init__(self, hold_timeout_s: float):
        self.hold_timeout_s = hold_timeout_s
        self.held: dict[str, float] = {}  # prefill side: request id -> when its blocks are freed anyway
        # decode side: requests whose KV is being pulled (None: it ended meanwhile, its blocks wait for the pull)
        self.fetching: dict[str, Request | None] = {}
        self._pulls: list[KVPull] = []

    def in_use(self, request_id: str) -> bool:
        return request_id in self.held or request_id in self.fetching

    # -- prefill side ------------------------------------------------------------------
    def hold(self, request_id: str, now: float) -> None:
        self.held[request_id] = now + self.hold_timeout_s

    def release(self, kv, request_id: str) -> bool:
        """Free a held request's blocks; False if it holds none (released already, or timed out)."""
        if self.held.pop(request_id, None) is None:
            return False
        kv.free_request(request_id)
        return True

    def expire(self, kv, now: float) -> list[str]:
        expired = [rid for rid, deadline in self.held.items() if deadline <= now]
        for rid in expired:
            self.release(kv, rid)
        return expired

    # -- decode side -------------------------------------------------------------------
    def start_pull(self, request: Request, block_ids: list[int]) -> None:
        self.fetching[request.request_id] = request
        self._pulls.append(KVPull(request.request_id, block_ids, request.kv_source))

    def take_pulls(self) -> list[KVPull]:
        pulls, self._pulls = self._pulls, []
        return pulls

    def pulled(self, kv, request_id: str, ok: bool, waiting: deque) -> bool:
        """A pull ended: the request goes to the front of the waiting queue, its prompt computed (ok) or to be
        computed (its blocks freed). False when it is gone (aborted meanwhile)."""
        if request_id not in self.fetching:
            return False
        request = self.fetching.pop(request_id)
        if request is None:  # it ended during the pull: only now may its blocks go to another request
            kv.free_request(request_id)
            return False
        if ok:
            request.num_computed_tokens = request.kv_source.num_tokens
            kv.cache_full_blocks(request_id, request.all_token_ids, request.num_computed_tokens)
        else:
            kv.free_request(request_id)
        request.kv_ready, request.kv_source = ok, None
        waiting.appendleft(request)
        return True

    def abandon(self, request_id: str) -> bool:
        """The request ended while its KV is being pulled: True, and its blocks stay allocated until the pull
        ends (the stages may still be writing into them)."""
        if self.fetching.get(request_id) is None:
            return False
        self.fetching[request_id] = None
        return True

    def pending(self) -> list[Request]:
        return [r for r in self.fetching.values() if r is not None]


async def run_pull(pipeline, epoch: int, pull: KVPull, observer) -> bool:
    """Every stage fetches its layers of the pull's KV (Pipeline.pull_kv); whether they all did."""
    start = time.perf_counter()
    try:
        moved = await pipeline.pull_kv(epoch, pull)
    except Exception as err:  # noqa: BLE001 - any failure of the transfer: the prompt is computed instead
        log.warning("request %s: fetching its prompt's KV from %s failed (%s): computing the prompt here",
                    pull.request_id, pull.source.scheduler_address, err)
        observer.kv_pulled(False, time.perf_counter() - start)
        return False
    seconds = time.perf_counter() - start
    log.info("request %s: its prompt's KV (%d tokens, %.1f MB) fetched from %s in %.3fs", pull.request_id,
             pull.source.num_tokens, moved / 1e6, pull.source.scheduler_address, seconds)
    observer.kv_pulled(True, seconds)
    return True
