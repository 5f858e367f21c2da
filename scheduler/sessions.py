"""Resumable requests: a request outlives the router that submitted it.

A request submitted resumable (SubmitRequest.resumable: the router streams its answer) gets a Session as its
sink: a journal of everything it produced so far (tokens, logprobs, prompt logprobs, its finish or its error)
and the connection its outputs go to now. When that connection breaks (its router died, or stopped and closed
its streams) the request stays, running and journaled, for --resume-grace-period seconds. A router that
attaches it by id (SubmitStreamRequest.attaches) gets the journal as one update and its outputs from then on,
and rebuilds the text from the token ids. A session whose grace ends unattached is aborted (its KV freed) and
forgotten; one its router releases (the answer is written) is forgotten at once.
"""
from __future__ import annotations

import asyncio
import hmac
import logging
import time
from dataclasses import dataclass, field, replace
from typing import Protocol

from scheduler.connection import Connection
from scheduler.request import RequestOutput
from stagemesh.core.engine_request import EngineRequest
from stagemesh.core.step import SampledToken
from stagemesh.core.errors import StagemeshError

log = logging.getLogger("stagemesh.scheduler")
SWEEP_INTERVAL_S = 1.0


class NotHeld(StagemeshError):
    """An attach of a request this replica does not hold (unknown, released, or its grace ended)."""


class Taken(StagemeshError):
    """The request was attached on another stream: this one gets nothing more of it."""


class Requests(Protocol):
    """What sessions need of the replica's driver."""

    def release(self, request_id: str) -> None: ...


@dataclass
class Session:
    request_id: str
    prompt: list[int]
    connection: Connection | None
    journal: RequestOutput  # everything so far, merged (a continuation's earlier tokens first)
    error: RequestOutput | None = None  # the failure that ended it, after the journal's tokens
    owner: str = ""  # who submitted it (EngineRequest.owner): an attach must name the same
    expires: float | None = None  # detached: when its grace ends
    released: bool = field(default=False, repr=False)

    @property
    def finished(self) -> bool:
        return self.error is not None or self.journal.finished

    def put(self, out: RequestOutput) -> None:
        """An output of the request (the driver's sink interface): journaled, then sent on if attached."""
        self._record(out)
        if self.connection is not None:
            self.connection.put(out)

    def _record(self, out: RequestOutput) -> None:
        if out.finish_reason == "error":
            self.error = out
            return
        j = self.journal
        j.new_token_ids.extend(out.new_token_ids)
        j.new_logprobs.extend(out.new_logprobs)
        if out.prompt_logprobs:
            if not j.prompt_logprobs:
                j.prompt_logprobs_start = out.prompt_logprobs_start
            j.prompt_logprobs.extend(out.prompt_logprobs)
        if not j.num_prompt_tokens and out.num_prompt_tokens:
            j.num_prompt_tokens, j.num_cached_tokens = out.num_prompt_tokens, out.num_cached_tokens
        if j.queue_seconds is None:
            j.queue_seconds = out.queue_seconds
        if out.finished:
            j.finish_reason, j.stop_token_id, j.held_kv = out.finish_reason, out.stop_token_id, out.held_kv

    def snapshot(self) -> list[RequestOutput]:
        """The journal as outputs to send a router that attaches: the tokens so far (and the finish), then the
        error if one ended it."""
        j = self.journal
        outs = [replace(j, new_token_ids=list(j.new_token_ids), new_logprobs=list(j.new_logprobs),
                        prompt_logprobs=list(j.prompt_logprobs))]
        return outs + ([self.error] if self.error is not None else [])


def _coming_back(old: Session, r: EngineRequest, connection: Connection) -> bool:
    """A request this replica handed on (drained, rebalanced: it ended "migrated" here), sent back by the router
    that moved it, for the same owner: its finished half here gives way to the new one. (That router keeps the
    half until the answer is written, so that its successor could resume a move it died in; a rebalance may
    bring the request back before then.)"""
    return (old.connection is connection and old.error is None and old.journal.finish_reason == "migrated"
            and hmac.compare_digest(r.owner.encode(), old.owner.encode()))


class Sessions:
    """The replica's resumable requests, by id."""

    def __init__(self, requests: Requests, grace_s: float):
        self.requests, self.grace_s = requests, grace_s
        self._sessions: dict[str, Session] = {}

    def __len__(self) -> int:
        return len(self._sessions)

    @property
    def num_kept(self) -> int:
        """Finished requests no router holds: their outputs kept for a resume."""
        return sum(s.connection is None and s.finished for s in self._sessions.values())

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._sessions

    def open(self, r: EngineRequest, connection: Connection) -> Session:
        """A session for a request about to be added (its sink); a continuation's earlier tokens (and their
        logprobs) begin its journal."""
        old = self._sessions.get(r.request_id)
        if old is not None and not _coming_back(old, r, connection):
            raise StagemeshError(f"request id {r.request_id!r} is already in use (a stream of that id can be resumed "
                                 "for --resume-grace-period after its router went away)")
        earlier = [SampledToken(-1, e.token_id, e.logprob, list(e.top_token_ids), list(e.top_logprobs))
                   for e in r.generated_logprobs]
        journal = RequestOutput(r.request_id, list(r.generated_token_ids), new_logprobs=earlier)
        session = Session(r.request_id, list(r.prompt_token_ids), connection, journal, owner=r.owner)
        self._sessions[r.request_id] = session
        return session

    def drop(self, request_id: str) -> None:
        """A session whose request was refused when it was added."""
        self._sessions.pop(request_id, None)

    def attach(self, request_id: str, prompt: list[int], owner: str, connection: Connection) -> None:
        """Send the request's outputs to `connection` from now on, its journal first. Raises NotHeld (also for
        another owner than the request's: no other client learns that the id is in use), or StagemeshError when
        the prompt is not the request's."""
        session = self._sessions.get(request_id)
        if session is None or not hmac.compare_digest(owner.encode(), session.owner.encode()):
            raise NotHeld(f"no request {request_id!r} is held here to resume (unknown, released, or its "
                          "--resume-grace-period passed)")
        if list(prompt) != session.prompt:
            raise StagemeshError(f"request {request_id!r} runs another prompt: a resume must send the request "
                                 "exactly as it was first sent")
        old = session.connection
        if old is not None and old is not connection:
            old.forget(request_id)
            old.reject(request_id, Taken(f"request {request_id!r} was resumed on another stream"))
        session.connection, session.expires = connection, None
        connection.added(request_id)
        for out in session.snapshot():
            connection.put(out)
        log.info("request %s resumed: %d token(s) so far%s", request_id, len(session.journal.new_token_ids),
                 ", finished" if session.finished else "")

    def stop(self, request_id: str, connection: Connection) -> bool:
        """The router aborts the request (a stop string, its client left): it stops and frees its KV now; its
        journal stays until the router releases it. False: not a session of this connection."""
        session = self._sessions.get(request_id)
        if session is None or session.connection is not connection:
            return False
        connection.forget(request_id)
        if not session.finished:
            self.requests.release(request_id)
            session.journal.finish_reason = "abort"
        return True

    def release(self, request_id: str, connection: Connection) -> None:
        """The router is done with the request: forget it (abort it first if it still runs)."""
        session = self._sessions.get(request_id)
        if session is None or session.connection is not connection:
            return
        del self._sessions[request_id]
        connection.forget(request_id)
        if not session.finished:
            self.requests.release(request_id)

    def detach(self, connection: Connection) -> set[str]:
        """The connection broke: its sessions wait for a router to attach them, for the grace period (none:
        they end now). Returns their ids."""
        mine = [s for s in self._sessions.values() if s.connection is connection]
        expires = time.monotonic() + self.grace_s
        for session in mine:
            session.connection, session.expires = None, expires
        if mine:
            running = sum(not s.finished for s in mine)
            log.warning("a submit stream broke with %d resumable request(s) (%d running): kept %.0fs for a router "
                        "to resume them", len(mine), running, self.grace_s)
        if not self.grace_s:
            self.sweep(expires)
        return {s.request_id for s in mine}

    def sweep(self, now: float) -> None:
        """End the sessions whose grace is over: abort the ones still running, forget them all."""
        over = [s for s in self._sessions.values() if s.expires is not None and s.expires <= now]
        for session in over:
            del self._sessions[session.request_id]
            if not session.finished:
                self.requests.release(session.request_id)
        if over:
            log.warning("%d request(s) left unresumed for %.0fs ended (%d aborted, KV freed)", len(over),
                        self.grace_s, sum(not s.finished for s in over))

    async def sweep_loop(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_INTERVAL_S)
            self.sweep(time.monotonic())
