"""What every HTTP handler of the gateway reads: the app's shared parts (replicas, tokenizer, settings) and a
generation's request id and owner."""
from __future__ import annotations

import hashlib
import uuid
from dataclasses import replace

from aiohttp import web

from router import resume
from router.config import RouterConfig
from router.errors import bad_request
from router.replica_set import ReplicaSet
from router.request import GenerateRequest
from router.tokenization import Tokenizer

class Lifecycle:
    """Whether the router takes new work (it drains once told to stop), and the HTTP requests it is serving."""

    def __init__(self) -> None:
        self.draining = False
        self.active = 0  # requests being answered (not /health, /ready or /metrics)
        self.listening = False  # its HTTP port is bound (the control port's readiness waits for it)
        # --listen-when-ready: /health says 503 until a replica has served once (then it is liveness)
        self.starting = False


REPLICAS = web.AppKey("replicas", ReplicaSet)
TOKENIZER = web.AppKey("tokenizer", Tokenizer)
CONFIG = web.AppKey("config", RouterConfig)
LIFECYCLE = web.AppKey("lifecycle", Lifecycle)
PROBES = ("/health", "/ready", "/metrics")  # answered while draining, not counted as work
MAX_REQUEST_ID = 200


def request_id(request: web.Request, req: GenerateRequest) -> str:
    """X-Request-Id (or the body's request_id, or a new one), the id the request has in logs, traces and the
    scheduler; the answer's id is it with OpenAI's prefix."""
    given = request.headers.get("X-Request-Id") or req.request_id
    return uuid.uuid4().hex if given is None else checked_request_id(given)


def owner_of(request: web.Request) -> str:
    """Whom a resumable request belongs to: a digest of the credential its client presented (Authorization), never
    the credential. A resume must present the same one: another key's finds no such request (a 404)."""
    given = request.headers.get("Authorization", "").encode()
    return hashlib.blake2b(given, digest_size=16, person=b"stagemesh-owner").hexdigest()


def resumable(request: web.Request, req: GenerateRequest, stream: bool) -> str | None:
    """A stream to a client that accepts event streams is resumable (router.resume), and belongs to that client
    (owner_of); returns the client's Last-Event-ID when the request resumes one such a client started (a stream,
    with its request id: checked here)."""
    last = request.headers.get(resume.HEADER)
    req.resumable = stream and resume.wants_event_ids(request.headers.get("Accept", ""))
    req.engine = replace(req.engine, owner=owner_of(request))
    if last is None:
        return None
    if not stream:
        raise bad_request(f"{resume.HEADER} resumes a stream: 'stream' must be true", resume.HEADER)
    if not (request.headers.get("X-Request-Id") or req.request_id):
        raise bad_request(f"{resume.HEADER} resumes the stream of a request id: send it (X-Request-Id)", "request_id")
    req.resumable = True
    return last


def checked_request_id(given: str) -> str:
    if not 0 < len(given) <= MAX_REQUEST_ID or not given.isprintable() or not given.isascii():
        raise bad_request(f"the request id (X-Request-Id or 'request_id') must be 1 to {MAX_REQUEST_ID} printable "
                          "ASCII characters", "request_id")
    return given
