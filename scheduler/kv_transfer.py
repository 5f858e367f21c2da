"""Disaggregated prefill in the scheduler's core (docs/disaggregated-prefill.md).

Prefill side: a prefill_only request ends once its prompt is computed and its first token sampled
("prefilled"); its KV blocks stay allocated, held for a decode replica until it releases them
(ReleaseKV) or the hold times out (--kv-hold-timeout). Decode side: a request whose prompt's KV is held
elsewhere (kv_source) gets blocks for its prompt, then waits while the driver pulls the KV into them
(every stage fetches its layers from the prefill replica's stages), and has the prefill replica release
it (its answer proves the blocks were still held, so never freed and reused, while they were read); once
pulled it runs as if it had computed its prompt here. If the KV cannot be loaded (the pull failed or ran
past --kv-load-timeout, the hold had expired, the KV does not fit this replica, its scheduler is not a
--kv-peer), vLLM's kv_load_failure_policy decides: "fail" (the default) ends the request with the reason
(FAILED_PRECONDITION, KVLoadFailed: the router may prefill it again), "recompute" computes its prompt here
like any request. Nothing waits forever: the load has a bound, the hold a timeout, and a request that ends
before its KV is loaded has the prefill replica release it at once.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from scheduler.kv_sources import Found
from scheduler.request import Request
from scheduler.status import Status
from stagemesh.core.engine_request import KVSourceInfo
from stagemesh.core.errors import StagemeshError


log = logging.getLogger("stagemesh.scheduler")


MAX_KV_SOURCE_STAGES = 1024
MAX_ADDRESS_LEN = 255


def check_kv_source(k: KVSourceInfo) -> KVSourceInfo:
    """Where a prompt's KV is held, as a decode replica gets it; sizes bounded here, the rest checked where it is
    used (the scheduler: against the prompt; each stage: the layers, blocks and chunks it reads)."""
    if len(k.stages) > MAX_KV_SOURCE_STAGES or any(len(a) > MAX_ADDRESS_LEN for a in
                                                   (k.scheduler_address, *(s[0] for s in k.stages))):
        raise StagemeshError("kv_transfer: too many stages, or an address longer than 255 characters")
    if not k.stages or any(not 0 <= s < e for _, s, e in k.stages) or k.num_tokens < 1:
        raise StagemeshError("kv_transfer: its stages must hold layers A:B with 0 <= A < B, and its tokens be >= 1")
    return k


class KVLoadFailed(StagemeshError):
    """A request's prompt KV cannot be loaded from its prefill replica and the kv_load_failure_policy is fail:
    the request fails (FAILED_PRECONDITION), never computing its prompt here."""


# why a prompt's KV could not be loaded (stagemesh:kv_transfer_failures_total{reason})
FAILURE_REASONS = ("timeout", "unreachable", "refused", "stale", "hold_expired", "not_peer", "not_fit", "error")


def failure_message(request_id: str, scheduler_address: str, reason: str, detail: str) -> str:
    return (f"request {request_id}: its prompt's KV could not be loaded from the prefill replica "
            f"{scheduler_address[:200]} ({reason}: {detail[:300]}); kv_load_failure_policy fail: the prompt is not "
            "computed on this decode replica")


def not_fit_message(request_id: str, src: KVSourceInfo, num_tokens: int, block_size: int) -> str:
    """Why the KV held for a request (of num_tokens: its prompt and generated tokens but the last) cannot be
    used on a replica of block_size (scheduler.kv_accounting.KVAccounting.kv_source_fits)."""
    return failure_message(
        request_id, src.scheduler_address, "not_fit", f"the KV held there ({src.num_tokens} tokens in blocks of "
        f"{src.block_size}) does not fit this replica (the KV of {num_tokens} tokens, its prompt and generated "
        f"tokens but the last, in blocks of {block_size}; no prompt logprobs, no draft model, no hybrid KV cache "
        "manager)")


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
        # decode side: KV held on prefill replicas for requests that ended before it was loaded: released at once
        self._releases: list[KVSourceInfo] = []
        self.released: set[str] = set()  # ... and whose pull, still running, must not release it again

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

    # -- decode side: a KV source (scheduler.kv_sources), the prefill replica that holds a request's prompt ----
    def find(self, request: Request, shared: list[int]) -> Found | None:
        source = request.kv_source
        return Found(source.num_tokens, only=True) if source is not None else None

    def bring(self, request: Request, block_ids: list[int], found: Found) -> None:
        self.start_pull(request, block_ids)

    def start_pull(self, request: Request, block_ids: list[int]) -> None:
        self.fetching[request.request_id] = request
        request.status = Status.WAITING_FOR_REMOTE_KV
        assert request.kv_source is not None  # (a request that pulls its KV names where from)
        self._pulls.append(KVPull(request.request_id, block_ids, request.kv_source))

    def take_pulls(self) -> list[KVPull]:
        pulls, self._pulls = self._pulls, []
        return pulls

    def pulled(self, kv, request_id: str, ok: bool) -> Request | None:
        """A pull ended: the request, its prompt computed (ok) or not (its blocks freed); None when it is gone
        (aborted meanwhile)."""
        self.released.discard(request_id)
        if request_id not in self.fetching:
            return None
        request = self.fetching.pop(request_id)
        if request is None:  # it ended during the pull: only now may its blocks go to another request
            kv.free_request(request_id)
            return None
        assert request.kv_source is not None
        if ok:
            request.num_computed_tokens = request.kv_source.num_tokens
            kv.cache_full_blocks(request_id, request.all_token_ids, request.num_computed_tokens, request.hash_root)
        else:
            kv.free_request(request_id)
        request.kv_source, request.status = None, Status.WAITING  # (ok: its blocks hold its prompt's KV)
        return request

    def abandon(self, request: Request) -> bool:
        """The request ended before its KV was loaded: its prefill replica is told to release that KV at once.
        True when its KV is being pulled: its blocks stay allocated until the pull ends (the stages may still be
        writing into them)."""
        request_id = request.request_id
        source = request.kv_source
        if source is not None:
            request.kv_source = None
            self._releases.append(source)
        if self.fetching.get(request_id) is None:
            return False
        self.fetching[request_id] = None
        self.released.add(request_id)
        return True

    def requeue_releases(self, sources: list[KVSourceInfo]) -> None:
        self._releases.extend(sources)

    def take_releases(self) -> list[KVSourceInfo]:
        releases, self._releases = self._releases, []
        return releases

    def pending(self) -> list[Request]:
        return [r for r in self.fetching.values() if r is not None]


def reason_of(err: BaseException) -> str:
    """One of FAILURE_REASONS for a failed pull (its stages' errors carry their gRPC status names)."""
    text = str(err)
    if isinstance(err, TimeoutError) or "DEADLINE_EXCEEDED" in text:
        return "timeout"
    if "PERMISSION_DENIED" in text:
        return "refused"
    if "UNAVAILABLE" in text:
        return "unreachable"
    if "epoch" in text:
        return "stale"
    return "error"


@dataclass
class PullResult:
    ok: bool
    reason: str = ""  # when not ok: one of FAILURE_REASONS
    detail: str = ""
    bytes: int = 0
    seconds: float = 0.0


async def run_pull(pipeline, epoch: int, pull: KVPull, policy: str, timeout_s: float, released: set[str],
                   spawn) -> PullResult:
    """Every stage fetches its layers of the pull's KV (Pipeline.pull_kv, bounded by timeout_s: a stalled
    prefill replica fails the pull then), then the prefill replica releases it, which it must still have held
    (else its blocks may have held another request's KV while they were read: the pull failed). A failed pull
    releases it in the background (`spawn`), so that the policy applies at once."""
    start = time.monotonic()
    src = pull.source
    try:
        moved = await pipeline.pull_kv(epoch, pull, timeout_s)
    except Exception as err:  # noqa: BLE001 - any failure of the transfer: the policy decides
        result = PullResult(False, reason_of(err), str(err) or type(err).__name__)
        if pull.request_id not in released:
            spawn(pipeline.release_kv(src))
    else:
        held = None
        if pull.request_id not in released:  # (an abort released it already: the request is gone anyway)
            left = max(timeout_s - (time.monotonic() - start), 1.0)
            held = await pipeline.release_kv(src, left)
        if held is False:
            result = PullResult(False, "hold_expired", "the prefill replica no longer held it when it was "
                                "read (--kv-hold-timeout passed, or its pipeline re-formed)", moved)
        elif held is None and pull.request_id not in released:
            result = PullResult(False, "unreachable", "the prefill replica's scheduler did not confirm that it "
                                "still held it", moved)
        else:
            result = PullResult(True, bytes=moved)
    seconds = result.seconds = time.monotonic() - start
    if result.ok:
        log.info("request %s: its prompt's KV (%d tokens, %.1f MB) fetched from %s in %.3fs", pull.request_id,
                 src.num_tokens, result.bytes / 1e6, src.scheduler_address, seconds)
    elif policy == "recompute":
        log.warning("request %s: fetching its prompt's KV from %s failed (%s: %s): computing the prompt here "
                    "(kv_load_failure_policy recompute)", pull.request_id, src.scheduler_address, result.reason,
                    result.detail)
    else:
        log.warning("request %s: fetching its prompt's KV from %s failed (%s: %s): the request fails "
                    "(kv_load_failure_policy fail)", pull.request_id, src.scheduler_address, result.reason,
                    result.detail)
    return result
