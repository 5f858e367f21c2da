"""One sequence sent through the replicas (dispatch): the replica it runs on, and where it goes on when that
one fails; disaggregated prefill's two halves; a resume attached where the request runs.

When the request's replica fails under it (UNAVAILABLE: its pipeline broke and was not back within its
--stage-recovery-timeout, or its scheduler died), the request goes on on another replica as a continuation:
the same prompt and sampling parameters with the tokens already streamed as its generated tokens, so the
scheduler there counts them against max_tokens and min_tokens, a seeded request draws the tokens it would
have drawn (the stages seed by (seed, position)), a structured-output constraint resumes where it was, and
the caller's detokenizer and stop strings simply go on (router.generation): the client sees no error, gap or
repeat. At most --max-request-retries times; never for a failure of the request's own input
(INVALID_ARGUMENT).

Disaggregated prefill: a new prompt goes to a prefill replica, which ends after the first token with its KV
held; the request goes on on a decode replica, which fetches that KV (kv_transfer) instead of computing the
prompt. Siblings of an n > 1 request run where their first choice runs; a resumed request is past that: where
it runs, it goes on. A decode replica that cannot load the prompt's KV fails it (its --kv-load-failure-policy
fail): the prompt is prefilled again, on another prefill replica when there is one, at most KV_LOAD_RETRIES
times; that prefill's token is not the client's (it has the first one), only its KV is used.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field, replace
from typing import AsyncGenerator, Sequence

import grpc

from router.errors import APIError, bad_request
from router.observe import RequestRecord, migrated
from router.replica_set import ReplicaSet
from router.replicas import Replica
from router.submit_stream import ReplicaOutput, RequestFailed, RequestStream
from stagemesh.core.engine_request import EngineRequest, KVSourceInfo
from stagemesh.core.sampling_params import SamplingParams
from stagemesh.core.step import TokenLogprob

log = logging.getLogger("stagemesh.router")
KV_LOAD_RETRIES = 1  # prefills again of a prompt whose KV a decode replica could not load
HEALTH_POLL_S = 0.25
_background: set[asyncio.Task] = set()


@dataclass
class Generation:
    """One sequence of a request: a choice (prompt x n), its own engine request (id, prompt, sampling
    parameters, priority, adapter, ...: the replicas get it whole, or a variant of it) and replica."""
    request: EngineRequest
    index: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    record: RequestRecord | None = None
    pin: str | None = None  # a replica it must run on (a sibling shares its prompt's cached blocks there)
    replica: str | None = None  # where it runs
    replays: int = 0  # times its replica failed and it went on elsewhere
    started: asyncio.Event = field(default_factory=asyncio.Event)  # its prompt is computed (or it ended)
    resume_from: int | None = None  # a resume: attach it where it runs; the client has this many of its tokens
    sibling: bool = False  # parallel sampling's choice 1.. of a prompt (sent once the first's prompt is computed)
    # its streams on replicas, released once the answer is written (a replica keeps a resumable request's
    # outputs until then, so that a router that dies while writing them loses nothing)
    holds: list = field(default_factory=list)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def prompt_ids(self) -> Sequence[int]:
        return self.request.prompt_token_ids

    @property
    def sampling(self) -> SamplingParams:
        return self.request.sampling

    def release(self) -> None:
        for stream in self.holds:
            stream.release()
        self.holds.clear()


async def dispatch(gen: Generation, replicas: ReplicaSet) -> AsyncGenerator[ReplicaOutput, None]:
    """The replies of the request's replica, and of the replicas it goes on on (Route): its tokens, with no
    gap or repeat, until it finishes."""
    if replicas.queue_full():
        raise APIError(429, f"the server is busy: {replicas.num_waiting} requests are already waiting for their "
                            f"first token (--max-waiting-requests {replicas.max_waiting_requests})", retry_after=1)
    route = Route(gen, replicas, prefill=gen.pin is None and gen.resume_from is None and replicas.disaggregated())
    replicas.num_waiting += 1
    try:
        while True:
            replica, stream, replies = await route.next_attempt()
            tenant = gen.request.tenant
            replica.tenants[tenant] += 1
            try:
                async for reply in replies:
                    if route.waiting:
                        replicas.num_waiting, route.waiting = replicas.num_waiting - 1, False
                    out, move_on = route.take(reply, replica)
                    if out is not None:
                        yield out
                    if move_on:
                        break
                else:
                    return
            except RequestFailed as err:
                route.on_failure(err, replica)  # (raises when it cannot go on)
            finally:
                replica.tenants[tenant] -= 1
                if replica.tenants[tenant] <= 0:
                    del replica.tenants[tenant]
                await replies.aclose()
                stream.close()  # unfinished (client gone, stop string): the scheduler aborts it
                if gen.request.resumable:
                    gen.holds.append(stream)
    finally:
        if route.waiting:
            replicas.num_waiting -= 1
        if route.held is not None:  # (the client went away before a decode replica was given its KV)
            _release_later(*route.held)


@dataclass
class Route:
    """Where one request went and goes next: the replicas it was sent to and that failed under it, the tokens
    generated so far (a continuation resumes from them) and its disaggregated prefill's state."""
    gen: Generation
    replicas: ReplicaSet
    prefill: bool  # its next submission is the prefill half
    waiting: bool = True  # no reply yet (it counts against --max-waiting-requests)
    tried: set[str] = field(default_factory=set)  # replicas it was sent to
    failed: set[str] = field(default_factory=set)  # replicas that failed under it
    moved_from: str = ""  # the replica that handed it on (drained, rebalanced): not its next one
    generated: list[int] = field(default_factory=list)  # tokens streamed so far
    generated_logprobs: list[TokenLogprob] = field(default_factory=list)  # theirs, when the request asks logprobs
    last_error: RequestFailed | None = None
    kv_transfer: KVSourceInfo | None = None  # its prompt's KV, held on a prefill replica
    kv_retries: int = 0
    redo_prefill: bool = False  # the prompt is prefilled again, for its KV only
    kv_failed_on: str = ""  # the prefill replica whose KV a decode replica could not load
    held: tuple | None = None  # (prefill replica, request id) holding KV no decode replica has been given yet
    prefilled_on: tuple | None = None  # ... and holding the KV of the last decode replica's kv_transfer
    migrating: bool = False  # its replica drained and handed it on: it goes on elsewhere (with kv_transfer: its KV)

    async def next_attempt(self) -> tuple[Replica, RequestStream, AsyncGenerator[ReplicaOutput, None]]:
        """(replica, its stream, the replies to read): a resume attached where the request runs, or the request
        (or its next half, or its continuation) submitted to the replica picked for it."""
        gen = self.gen
        found = await _attach(gen, gen.resume_from, self.replicas) if gen.resume_from is not None \
            and not self.tried else None
        if found is not None:  # a resume: where the request runs, its outputs so far
            replica, stream, so_far = found
            replies = _chain(so_far, stream)
        else:
            replica = self._pick()
            stream = replica.submit(_variant(gen.request, self.generated, self.generated_logprobs, self.prefill,
                                             self.kv_transfer, self.redo_prefill, self.kv_retries))
            if self.kv_transfer and not self.redo_prefill:  # the decode replica releases that KV from now on
                self.held = None
            replies = _chain([], stream)
            if self.prefill:  # a stalled prefill replica (it stops answering health checks) is left
                replies = _while_healthy(replies, replica)
        self.tried.add(replica.address)
        gen.replica = replica.address
        if gen.record is not None:
            gen.record.replica = replica.address
            if self.last_error is not None:
                gen.record.resumed(replica.address, len(self.generated))
        return replica, stream, replies

    def _pick(self) -> Replica:
        """Before its first token it tries each replica once; a continuation goes to any replica it has not failed
        on; a prompt prefilled again goes to another prefill replica than the one whose KV could not be loaded,
        if there is one. No prefill replica left: the whole request elsewhere."""
        pick = self.replicas.pick
        while True:
            if self.redo_prefill:
                replica = pick(self.gen.request, self.failed | {self.kv_failed_on}, None, "prefill") \
                    or pick(self.gen.request, self.failed, None, "prefill")
            else:
                avoid = (self.failed if self.generated else self.tried) | ({self.moved_from} - {""})
                replica = pick(self.gen.request, avoid, self.gen.pin, "prefill" if self.prefill else "whole")
                self.moved_from = ""
            if replica is not None:
                return replica
            if not self.prefill:
                break
            self.prefill = self.redo_prefill = False
        if self.last_error is not None:
            raise _api_error(self.last_error)  # nowhere else to try
        reasons = "; ".join(f"{r.address}: {r.reason}" for r in self.replicas.replicas) or "no replicas configured"
        raise APIError(503, f"no replica can serve this request right now ({reasons})", retry_after=2)

    def take(self, reply: ReplicaOutput, replica: Replica) -> tuple[ReplicaOutput | None, bool]:
        """(what the caller gets of a reply, or None; whether the request moves on to another replica now)."""
        if self.redo_prefill:  # the prompt prefilled again: its KV for a decode replica, not its token
            if reply.finish_reason != "prefilled":
                raise APIError(503, f"prefilling the prompt again on {replica.address} ended "
                                    f"{reply.finish_reason!r}", retry_after=2)
            self.prefill = self.redo_prefill = False
            self.kv_transfer = reply.kv_transfer
            self.held = self.prefilled_on = (replica, _retry_id(self.gen.request_id, self.kv_retries))
            return None, True
        if self.migrating:  # handed on by a draining replica, it goes on here
            migrated("kv" if self.kv_transfer is not None else "recompute")
            self.migrating = False
        self.generated.extend(reply.token_ids)
        self.generated_logprobs.extend(reply.logprobs)
        if reply.finish_reason == "migrated":  # drained or rebalanced: on to another, with its KV if it holds it
            self.moved_from = replica.address  # (a rebalanced one may come back to it later)
            self.migrating, self.kv_transfer = True, reply.kv_transfer
            if reply.kv_transfer is not None:
                self.held = self.prefilled_on = (replica, self.gen.request_id)
            return (replace(reply, finish_reason=None, kv_transfer=None) if reply.token_ids else None), True
        if reply.finish_reason == "prefilled":  # its first token: on to a decode replica
            self.prefill, self.kv_transfer = False, reply.kv_transfer
            self.held = self.prefilled_on = (replica, self.gen.request_id)
            return replace(reply, finish_reason=None, kv_transfer=None), True
        return reply, False

    def on_failure(self, err: RequestFailed, replica: Replica) -> None:
        """The replica failed the request: it goes on elsewhere (prefilled again, for a decode replica that could
        not load its KV), or the APIError the client gets is raised."""
        gen = self.gen
        if err.code == grpc.StatusCode.FAILED_PRECONDITION and self.kv_transfer and self.migrating:
            # the replica it was handed to could not load its KV: computed again (its policy: recompute)
            if self.prefilled_on is not None:
                _release_later(*self.prefilled_on)
            log.warning("request %s: %s could not load its KV (%s): it goes on computed again", gen.request_id,
                        replica.address, err.details)
            self.kv_transfer = self.held = None
            return
        if err.code == grpc.StatusCode.FAILED_PRECONDITION and self.kv_transfer:
            # the decode replica could not load the prompt's KV (--kv-load-failure-policy fail)
            if self.prefilled_on is not None:  # (a decode replica that refused it never dialled it to release)
                _release_later(*self.prefilled_on)
                self.kv_failed_on = self.prefilled_on[0].address
            if self.kv_retries >= KV_LOAD_RETRIES:
                raise APIError(503, f"the decode replica {replica.address} could not load the prompt's KV "
                                    f"(prefilled {self.kv_retries + 1} times): {err.details}", retry_after=2) from None
            self.kv_retries += 1
            log.warning("request %s: the decode replica %s could not load its prompt's KV (%s): prefilling it again",
                        gen.request_id, replica.address, err.details)
            self.prefill, self.redo_prefill, self.kv_transfer = True, True, None
            return
        if err.code == grpc.StatusCode.UNAVAILABLE:
            replica.mark_failed(f"a request failed there: {err.details}")
            self.failed.add(replica.address)
        if not _may_replay(err, self.waiting, gen, self.replicas.max_request_retries):
            raise _api_error(err) from None
        self.last_error, self.kv_transfer = err, None  # (its KV went with the decode replica that fetched it)
        gen.replays += 1
        if gen.record is not None:
            gen.record.replayed(replica.address, err.details, len(self.generated))


def _variant(request: EngineRequest, generated: list[int], logprobs: list[TokenLogprob], prefill: bool,
             kv_transfer: KVSourceInfo | None, redo_prefill: bool, kv_retries: int) -> EngineRequest:
    """What goes to a replica: the request, as a continuation of the tokens generated so far (its prompt
    logprobs delivered; the generated tokens' logprobs kept there for a resume), as the prefill half of a
    disaggregated request, or the decode half with its prompt's KV (kv_transfer); or its prompt prefilled again
    for a decode replica (only its KV counts: whatever its token, it ends "prefilled")."""
    sampling = replace(request.sampling, prompt_logprobs=None) if generated else request.sampling
    if redo_prefill:
        return replace(request, request_id=_retry_id(request.request_id, kv_retries), generated_token_ids=(),
                       generated_logprobs=(), sampling=replace(sampling, ignore_eos=True, stop_token_ids=(),
                                                                min_tokens=0), prefill_only=True, resumable=False)
    # (a prefill half is not kept for a resume: its one token goes on on a decode replica, which a resume must
    # find, not the prefill replica's finished half)
    return replace(request, sampling=sampling, generated_token_ids=list(generated),
                   generated_logprobs=list(logprobs) if len(logprobs) == len(generated) else [],
                   prefill_only=prefill, kv_source=kv_transfer, resumable=request.resumable and not prefill)


def _retry_id(request_id: str, n: int) -> str:
    return f"{request_id}-kvretry{n}"


def _release_later(replica, request_id: str) -> None:
    """Free the KV a prefill replica holds for a request no decode replica will load it for."""
    task = asyncio.get_running_loop().create_task(replica.release_kv(request_id))
    _background.add(task)
    task.add_done_callback(_background.discard)


async def _while_healthy(replies, replica):
    """The replies, until the replica stops passing health checks before the next one comes (a stalled prefill
    replica: its scheduler or a stage stopped): then RequestFailed UNAVAILABLE, and the request goes elsewhere."""
    it = replies.__aiter__()
    nxt: asyncio.Future | None = None
    try:
        while True:
            nxt = asyncio.ensure_future(it.__anext__())
            while True:
                done, _ = await asyncio.wait({nxt}, timeout=HEALTH_POLL_S)
                if done:
                    break
                if not replica.healthy:
                    raise RequestFailed(grpc.StatusCode.UNAVAILABLE, f"the prefill replica {replica.address} stopped "
                                        f"passing health checks ({replica.reason}) before the prompt was computed")
            try:
                reply = nxt.result()
            except StopAsyncIteration:
                return
            yield reply
    finally:
        if nxt is not None and not nxt.done():  # (the wait for the next reply ends before the replies are closed)
            nxt.cancel()
            await asyncio.wait({nxt})
        await replies.aclose()


async def _attach(gen: Generation, at: int, replicas: ReplicaSet):
    """(replica, stream, its outputs so far cut at `at`) of a request being resumed, or the 404 when no replica
    holds it (None: send it afresh)."""
    found = await replicas.attach(gen.request_id, list(gen.prompt_ids), gen.request.owner)
    if found is None and gen.sibling and not at:
        return None  # a choice that waited for its first sibling's prompt may never have been sent: send it now
    if found is None:
        raise APIError(404, f"no request {gen.request_id!r} to resume: unknown, finished and released, or left "
                            "unresumed past its replica's --resume-grace-period", "request_id")
    replica, stream, first = found
    return replica, stream, _split(first, at)


def _split(first: ReplicaOutput, at: int) -> list[ReplicaOutput]:
    """A resumed request's outputs so far, cut where the client's copy ends: the part it has (replayed without
    being written: it rebuilds the text) and the rest, so that deltas start where the client stopped."""
    n = len(first.token_ids)
    if at > n:
        raise bad_request(f"Last-Event-ID is past the end of the stream: a choice has {n} token(s), the client "
                          f"claims {at}", "Last-Event-ID")
    tail = n - at  # (a replica from before continuations kept their logprobs lacks the list's head then)
    lp = first.logprobs
    head_lp, tail_lp = (lp[:-tail], lp[-tail:]) if tail else (lp, [])
    had = replace(first, token_ids=first.token_ids[:at], logprobs=head_lp, finish_reason=None, stop_token_id=None,
                  kv_transfer=None)
    rest = ReplicaOutput(first.token_ids[at:], tail_lp, first.finish_reason, first.stop_token_id,
                         kv_transfer=first.kv_transfer)
    return [had, rest] if rest.token_ids or rest.finish_reason else [had]


async def _chain(firsts: list[ReplicaOutput], stream):
    for reply in firsts:
        yield reply
    async for reply in stream:
        yield reply


def _may_replay(err: RequestFailed, waiting: bool, gen: Generation, max_retries: int) -> bool:
    """Whether a failed request goes on elsewhere: its replica failed (not its own input), or before its first
    token the replica's queue was full; at most max_retries times."""
    if gen.replays >= max_retries:
        return False
    return err.code == grpc.StatusCode.UNAVAILABLE or (err.code == grpc.StatusCode.RESOURCE_EXHAUSTED and waiting)


def _api_error(err: RequestFailed) -> APIError:
    code, details = err.code, err.details
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return bad_request(details)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return APIError(429, f"the server is busy: {details}", retry_after=1)
    if code == grpc.StatusCode.UNAVAILABLE:
        return APIError(503, f"the replica failed: {details}", retry_after=2)
    return APIError(500, f"{code.name}: {details}")
