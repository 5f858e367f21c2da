"""What every HTTP handler of the gateway reads: the app's shared parts (replicas, tokenizer, settings) and,
before a generation, the request's admission (a healthy replica, the context length, its id)."""
from __future__ import annotations

import uuid

from aiohttp import web

from router.config import RouterConfig
from router.errors import APIError, bad_request
from router.generation import check_priority
from router.replicas import ReplicaSet
from router.request import GenerateRequest
from router.tokenization import Tokenizer

REPLICAS = web.AppKey("replicas", ReplicaSet)
TOKENIZER = web.AppKey("tokenizer", Tokenizer)
CONFIG = web.AppKey("config", RouterConfig)
MAX_REQUEST_ID = 200


def request_id(request: web.Request, req: GenerateRequest) -> str:
    """X-Request-Id (or the body's request_id, or a new one), the id the request has in logs, traces and the
    scheduler; the answer's id is it with OpenAI's prefix."""
    given = request.headers.get("X-Request-Id") or req.request_id
    if given is None:
        return uuid.uuid4().hex
    if not 0 < len(given) <= MAX_REQUEST_ID or not given.isprintable() or not given.isascii():
        raise bad_request(f"the request id (X-Request-Id or 'request_id') must be 1 to {MAX_REQUEST_ID} printable "
                          "ASCII characters", "request_id")
    return given


def admit(request: web.Request, req: GenerateRequest) -> tuple[int, str]:
    """(the context length it runs under, its id), or the error that keeps it out."""
    replicas = request.app[REPLICAS]
    if not replicas.healthy():
        raise APIError(503, "no healthy replica: " + "; ".join(f"{r.address}: {r.reason}" for r in replicas.replicas),
                       retry_after=2)
    max_len = min(filter(None, (replicas.max_model_len, request.app[CONFIG].max_model_len)))
    check_priority(req, replicas)
    return max_len, request_id(request, req)
