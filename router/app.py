"""The OpenAI-compatible HTTP gateway (aiohttp)."""
from __future__ import annotations

import asyncio
import hmac
import logging
import time
import uuid

from aiohttp import web

from router import responses
from router.errors import APIError, bad_request
from router.http_body import read_json
from router.generation import Generation, fit_max_tokens, generate, new_request_id, prompt_ids_for
from router.observe import metrics_handler
from router.openai_protocol import parse_request
from router.replicas import ReplicaSet
from router.tokenization import Tokenizer

REPLICAS = web.AppKey("replicas", ReplicaSet)
TOKENIZER = web.AppKey("tokenizer", Tokenizer)
CONFIG = web.AppKey("config", dict)
MAX_BODY_BYTES = 32 * 2**20
log = logging.getLogger("stagemesh.router")


@web.middleware
async def errors_and_auth(request: web.Request, handler):
    """Every answer but a success is an OpenAI-shaped JSON error, whatever went wrong; every endpoint but
    /health (and /metrics with --public-metrics) needs the API key when one is set."""
    config = request.app[CONFIG]
    key = config.get("api_key")
    open_paths = ("/health", "/metrics") if config.get("public_metrics") else ("/health",)
    if key and request.path not in open_paths and not _key_matches(request, key):
        return APIError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                        code="invalid_api_key").response()
    try:
        return await handler(request)
    except APIError as err:
        return err.response()
    except web.HTTPException as err:  # aiohttp's own: 404, 405, 413 (body too large), ...
        if err.status < 400:
            raise
        message = {404: f"no route {request.method} {request.path}",
                   405: f"{request.method} is not allowed on {request.path}"}.get(err.status, err.text or err.reason)
        return APIError(err.status, message, code=_HTTP_CODES.get(err.status, err.reason)).response()
    except asyncio.CancelledError:
        raise
    except Exception:  # a bug: logged with an id the client sees, never a bare 500 page
        incident = uuid.uuid4().hex[:12]
        log.exception("unexpected error serving %s %s (incident %s)", request.method, request.path, incident)
        return APIError(500, f"internal error (incident {incident}); the server log has the details",
                        code="internal_error").response()


_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}


def _key_matches(request: web.Request, key: str) -> bool:
    return hmac.compare_digest(request.headers.get("Authorization", "").encode(), f"Bearer {key}".encode())


async def _json(request: web.Request):
    return await read_json(request)


def _check_model(request: web.Request, model: str) -> None:
    served = request.app[CONFIG]["served_model_name"]
    if model != served:
        raise APIError(404, f"the model '{model}' does not exist; this server serves '{served}'", "model",
                       "model_not_found")


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=False)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=True)


async def _generate(request: web.Request, chat: bool) -> web.StreamResponse:
    req = parse_request(await _json(request), chat)
    _check_model(request, req.model)
    replicas, tokenizer = request.app[REPLICAS], request.app[TOKENIZER]
    if not replicas.healthy():
        raise APIError(503, "no healthy replica: " + "; ".join(f"{r.address}: {r.reason}" for r in replicas.replicas),
                       code="unavailable", retry_after=2)
    max_len = min(filter(None, (replicas.max_model_len, request.app[CONFIG].get("max_model_len"))))
    prompt_ids = await prompt_ids_for(req, tokenizer)
    fit_max_tokens(req, len(prompt_ids), max_len)
    gen = Generation(new_request_id(chat), prompt_ids)
    created = int(time.time())
    deltas = generate(req, gen, replicas, tokenizer)
    try:  # closing the generator cancels the call, so the scheduler aborts the request and frees its blocks
        if not req.stream:
            return web.json_response(await responses.collect(req, gen, deltas, created, tokenizer))
        return await _stream(request, req, gen, deltas, created, tokenizer)
    finally:
        await deltas.aclose()


async def _stream(request, req, gen, deltas, created, tokenizer) -> web.StreamResponse:
    first = await anext(deltas, None)  # errors before the first token still get an HTTP status
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    try:
        for chunk in responses.stream_head(req, gen, created):
            await resp.write(responses.sse(chunk))
        delta = first
        while delta is not None:
            await resp.write(responses.sse(responses.stream_chunk(req, gen, created, delta, tokenizer)))
            delta = await anext(deltas, None)
        if req.include_usage:
            await resp.write(responses.sse(responses.usage_chunk(req, gen, created)))
    except APIError as err:
        await resp.write(responses.sse(err.body()))
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:  # the status line is sent: the error goes in the stream, as an OpenAI error object
        incident = uuid.uuid4().hex[:12]
        log.exception("unexpected error while streaming %s (incident %s)", gen.request_id, incident)
        await resp.write(responses.sse(APIError(500, f"internal error (incident {incident})",
                                                code="internal_error").body()))
    await resp.write(b"data: [DONE]\n\n")
    return resp


async def models(request: web.Request) -> web.Response:
    name = request.app[CONFIG]["served_model_name"]
    return web.json_response({"object": "list", "data": [
        {"id": name, "object": "model", "created": 0, "owned_by": "stagemesh", "root": name,
         "max_model_len": request.app[REPLICAS].max_model_len or None}]})


async def health(request: web.Request) -> web.Response:
    replicas = request.app[REPLICAS]
    body = {"replicas": [{"address": r.address, "healthy": r.healthy, "reason": r.reason or None,
                          "running": r.num_running, "waiting": r.num_waiting} for r in replicas.replicas]}
    return web.json_response(body, status=200 if replicas.healthy() else 503)


async def tokenize(request: web.Request) -> web.Response:
    body = await _json(request)
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    tokenizer = request.app[TOKENIZER]
    if "messages" in body:
        ids = await prompt_ids_for(parse_request({**body, "model": body.get("model", "")}, chat=True), tokenizer)
    elif isinstance(body.get("prompt"), str):
        add_special = body.get("add_special_tokens", True)
        if not isinstance(add_special, bool):
            raise bad_request("'add_special_tokens' must be a boolean", "add_special_tokens")
        tokenizer.check_length(len(body["prompt"]), "prompt")
        ids = await tokenizer.run(tokenizer.encode, body["prompt"], add_special)
    else:
        raise bad_request("'prompt' (a string) or 'messages' is required", "prompt")
    return web.json_response({"tokens": ids, "count": len(ids), "max_model_len": request.app[REPLICAS].max_model_len})


async def detokenize(request: web.Request) -> web.Response:
    body = await _json(request)
    tokens = body.get("tokens") if isinstance(body, dict) else None
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise bad_request("'tokens' must be an array of integers", "tokens")
    tokenizer = request.app[TOKENIZER]
    if any(not 0 <= t < tokenizer.vocab_size for t in tokens):
        raise bad_request(f"token ids must be in [0, {tokenizer.vocab_size})", "tokens")
    return web.json_response({"prompt": await tokenizer.run(tokenizer.decode, tokens, False)})


def build_app(replicas: ReplicaSet, tokenizer: Tokenizer, config: dict) -> web.Application:
    app = web.Application(middlewares=[errors_and_auth], client_max_size=MAX_BODY_BYTES)
    app[REPLICAS], app[TOKENIZER], app[CONFIG] = replicas, tokenizer, config
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics_handler)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    return app
