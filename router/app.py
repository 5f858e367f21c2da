"""The OpenAI-compatible HTTP gateway (aiohttp)."""
from __future__ import annotations

import asyncio
import hmac
import logging
import time
import uuid

from aiohttp import web

from router import beam_choices, choices, lora_api, pooling_api, responses, resume
from router.admission import launch
from router.config import RouterConfig
from router.errors import APIError, bad_request
from router.http_body import read_json
from router.observe import metrics_handler
from router.openai_request import chat_request, completion_request
from router.openapi import openapi_document
from router.prompts import render
from router.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest, validate
from router.replica_set import ReplicaSet
from router.request import GenerateRequest, Prompt
from router.request_builder import chat_options, check_model
from router.responses_api import handlers as responses_api
from router.responses_api.store_flags import open_store
from router.state import (BATCH_CREDENTIAL, BATCH_TENANT_HEADER, CONFIG, LIFECYCLE, PROBES, REPLICAS, TENANT, TOKENIZER,
                          Lifecycle, request_id, resumable)
from router.tenants import Tenant, Tenants
from router.tokenization import Tokenizer

MAX_BODY_BYTES = 32 * 2**20
log = logging.getLogger("stagemesh.router")


@web.middleware
async def errors_and_auth(request: web.Request, handler):
    """Every answer but a success is an OpenAI-shaped JSON error, whatever went wrong; every endpoint but
    /health (and /metrics with --public-metrics) needs the API key when one is set."""
    config = request.app[CONFIG]
    open_paths = ("/health", "/ready", "/metrics") if config.public_metrics else ("/health", "/ready")
    if config.tenants is not None and request.path not in open_paths:
        tenant = config.tenants.tenant(request.headers) or _batch_line_tenant(request, config.tenants)
        if tenant is None:
            return APIError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')").response()
        request[TENANT] = tenant
    lifecycle = request.app[LIFECYCLE]
    if request.path in PROBES:
        return await _answer(request, handler)
    # draining, the router listens no more (new connections go to the other routers): what still comes on a
    # connection it had accepted is served, and the connection closed after it
    lifecycle.active += 1
    try:
        resp = await _answer(request, handler)
        if lifecycle.draining:
            resp.force_close()
        return resp
    finally:
        lifecycle.active -= 1


def _batch_line_tenant(request: web.Request, tenants: Tenants) -> Tenant | None:
    """A Batch API line this router's runner sends (router.batch.runner): the tenant that created its batch."""
    credential = request.app.get(BATCH_CREDENTIAL)
    if credential is None or not hmac.compare_digest(request.headers.get("Authorization", "").encode(),
                                                     f"Bearer {credential}".encode()):
        return None
    return tenants.by_name(request.headers.get(BATCH_TENANT_HEADER, ""))


async def _answer(request: web.Request, handler):
    try:
        return await handler(request)
    except APIError as err:
        return err.response()
    except web.HTTPException as err:  # aiohttp's own: 404, 405, 413 (body too large), ...
        if err.status < 400:
            raise
        path = request.path if len(request.path) <= 200 else request.path[:200] + "..."
        message = {404: f"no route {request.method} {path}",
                   405: f"{request.method} is not allowed on {path}"}.get(err.status, err.text or err.reason)
        return APIError(err.status, message).response()
    except (asyncio.CancelledError, ConnectionResetError):  # the client left: nobody to answer
        raise
    except Exception:  # a bug: logged with an id the client sees, never a bare 500 page
        incident = uuid.uuid4().hex[:12]
        log.exception("unexpected error serving %s %s (incident %s)", request.method, request.path, incident)
        return APIError(500, f"internal error (incident {incident}); the server log has the details").response()


def _generates(request: web.Request, api: str) -> None:
    """A pooling model generates nothing: vLLM's 400 for the generation APIs."""
    if request.app[CONFIG].pooler is not None:
        raise bad_request(f"The model does not support {api}")


async def completions(request: web.Request) -> web.StreamResponse:
    _generates(request, "Completions API")
    model = validate(CompletionRequest, await read_json(request))
    config = request.app[CONFIG]
    return await _generate(request, completion_request(model, config))


async def chat_completions(request: web.Request) -> web.StreamResponse:
    _generates(request, "Chat Completions API")
    model = validate(ChatCompletionRequest, await read_json(request))
    config = request.app[CONFIG]
    return await _generate(request, chat_request(model, config))


async def _generate(request: web.Request, req: GenerateRequest) -> web.StreamResponse:
    replicas, tokenizer = request.app[REPLICAS], request.app[TOKENIZER]
    base = request_id(request, req)
    _resumable(request, req)
    answer_id = f"{'chatcmpl' if req.chat else 'cmpl'}-{base}"
    prompts, gens = await launch(req, replicas, tokenizer, request.app[CONFIG], answer_id)
    texts: list[Prompt | None] = [*req.prompts] or [None]  # (a chat's one prompt has none)
    echoes = [await _echo_text(req, p, ids, tokenizer) for p, ids in zip(texts, prompts)]
    answer = responses.Answer(req, answer_id, int(time.time()), gens, tokenizer, echoes)
    headers = {"X-Request-Id": base, **req.rate_headers}
    deltas = (beam_choices if req.beam is not None else choices).run(req, gens, replicas, tokenizer)
    try:  # closing it cancels every choice, so the scheduler aborts them and frees their blocks
        if not req.stream:
            async for gen, delta in deltas:
                answer.add(gen, delta)
            return web.json_response(answer.body(), headers=headers)
        return await _stream(request, req, answer, deltas, headers,
                             resume.EventIds(req.num_choices, req.resume, enabled=req.resumable))
    finally:
        await deltas.aclose()


def _resumable(request: web.Request, req: GenerateRequest) -> None:
    """With Last-Event-ID the request is a resume of a stream (router.state.resumable); a beam search's steps are
    requests of their own, kept nowhere for a resume."""
    if req.beam is not None and resume.HEADER in request.headers:
        raise bad_request(f"{resume.HEADER}: a beam search's stream is not resumable", resume.HEADER)
    last = resumable(request, req, req.stream)
    if req.beam is not None:
        req.resumable = False
    if last is not None:
        req.resume = resume.ResumePoint.parse(last, req.num_choices)


async def _echo_text(req: GenerateRequest, prompt, ids: list[int], tokenizer: Tokenizer) -> str:
    """What echo puts before the answer: the prompt (completions), or the final assistant message that the
    answer continues (chat, with continue_final_message: vLLM's chat echo)."""
    if not req.echo:
        return ""
    if req.chat:
        assert req.chat_options is not None  # (the request builder sets them for a chat)
        last = req.chat_options.messages[-1]
        return (last["content"] or "") if last["role"] == "assistant" else ""
    if prompt.text is not None and req.truncate_prompt_tokens is None:
        return prompt.text
    return await tokenizer.run(tokenizer.decode, ids, req.skip_special_tokens)


async def _stream(request, req, answer, deltas, headers, ids: resume.EventIds) -> web.StreamResponse:
    """The answer as Server-Sent Events, each with its id when the client asked for them; a resume writes only
    what its client lacks."""
    first = await anext(deltas, None)  # errors before the first output still get an HTTP status
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", **headers})
    await resp.prepare(request)
    try:
        item = first
        while item is not None:
            gen, delta = item
            chunks = answer.chunks(gen, delta)
            for event_id, chunk in ids.delta(gen.index, len(delta.token_ids), bool(delta.finish_reason), chunks):
                await resp.write(responses.sse(chunk, event_id))
            item = await anext(deltas, None)
        if req.include_usage and ids.usage_due:
            await resp.write(responses.sse(answer.usage_chunk(), ids.usage()))
    except APIError as err:
        await resp.write(responses.sse(err.body(), ids.error()))
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:  # the status line is sent: the error goes in the stream, as an OpenAI error object
        incident = uuid.uuid4().hex[:12]
        log.exception("unexpected error while streaming %s (incident %s)", answer.id, incident)
        await resp.write(responses.sse(APIError(500, f"internal error (incident {incident})").body(), ids.error()))
    await resp.write(responses.sse_done(ids.done()))
    return resp


async def models(request: web.Request) -> web.Response:
    """The served model, then its LoRA adapters with their parent (vLLM's /v1/models)."""
    config = request.app[CONFIG]
    name, max_model_len = config.served_model_name, request.app[REPLICAS].max_model_len or None
    return web.json_response({"object": "list", "data": [
        {"id": name, "object": "model", "created": 0, "owned_by": "stagemesh", "root": name, "parent": None,
         "max_model_len": max_model_len},
        *({"id": adapter, "object": "model", "created": 0, "owned_by": "stagemesh", "root": path,
           "parent": config.lora.parent(adapter) or name, "max_model_len": max_model_len}
          for adapter, path in config.lora.paths().items())]})


async def health(request: web.Request) -> web.Response:
    """Liveness (vLLM's /health): 200 while this process serves, whatever its replicas' state (a router whose
    replicas are down must not be restarted for it); the body says what /ready judges by. A router started with
    --listen-when-ready (serve's) says 503 until a replica has served once: vLLM's start-up, where /health 200
    means a request can be answered."""
    return web.json_response(_state(request), status=503 if request.app[LIFECYCLE].starting else 200)


async def ready(request: web.Request) -> web.Response:
    """Readiness: 200 while the router takes new work (a replica can serve it and it is not draining), 503
    otherwise, for load balancers and Kubernetes' readinessProbe."""
    body = _state(request)
    return web.json_response(body, status=200 if body["ready"] else 503)


def _state(request: web.Request) -> dict:
    replicas, lifecycle = request.app[REPLICAS], request.app[LIFECYCLE]
    return {"ready": bool(replicas.healthy()) and not lifecycle.draining, "draining": lifecycle.draining,
            "replicas": [{"address": r.address, "healthy": r.healthy, "cordoned": r.cordoned,
                          "reason": r.reason or None, "running": r.num_running, "waiting": r.num_waiting}
                         for r in replicas.replicas]}


async def tokenize(request: web.Request) -> web.Response:
    m = validate(TokenizeRequest, await read_json(request))
    tokenizer, config = request.app[TOKENIZER], request.app[CONFIG]
    check_model(m.model, config.served_model_name, config.adapter_names)
    if m.messages is not None:
        options = chat_options(m.messages, m.add_generation_prompt, m.continue_final_message, m.chat_template,
                               m.chat_template_kwargs, m.documents)
        ids = await render(options, tokenizer, bool(m.add_special_tokens))
    elif m.prompt is not None:
        tokenizer.check_length(len(m.prompt), "prompt")
        add_special = True if m.add_special_tokens is None else m.add_special_tokens
        ids = await tokenizer.run(tokenizer.encode, m.prompt, add_special)
    else:
        raise bad_request("'prompt' (a string) or 'messages' is required", "prompt")
    body = {"tokens": ids, "count": len(ids), "max_model_len": request.app[REPLICAS].max_model_len}
    if m.return_token_strs:
        body["token_strs"] = await tokenizer.run(tokenizer.tok.convert_ids_to_tokens, ids)
    return web.json_response(body)


async def detokenize(request: web.Request) -> web.Response:
    body, tokenizer = await read_json(request), request.app[TOKENIZER]
    if isinstance(body, dict) and isinstance(body.get("tokens"), list):  # counted before each id is checked
        tokenizer.check_token_count(len(body["tokens"]), "tokens")
    m = validate(DetokenizeRequest, body)
    if any(not 0 <= t < tokenizer.vocab_size for t in m.tokens):
        raise bad_request(f"token ids must be in [0, {tokenizer.vocab_size})", "tokens")
    return web.json_response({"prompt": await tokenizer.run(tokenizer.decode, m.tokens, False)})


async def version(request: web.Request) -> web.Response:
    from stagemesh import __version__

    return web.json_response({"version": __version__})


async def openapi(request: web.Request) -> web.Response:
    return web.json_response(openapi_document())


def build_app(replicas: ReplicaSet, tokenizer: Tokenizer, config: RouterConfig) -> web.Application:
    app = web.Application(middlewares=[errors_and_auth], client_max_size=MAX_BODY_BYTES)
    app[REPLICAS], app[TOKENIZER], app[CONFIG], app[LIFECYCLE] = replicas, tokenizer, config, Lifecycle()
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics_handler)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/version", version)
    app.router.add_get("/openapi.json", openapi)
    lora_api.add_routes(app)  # vLLM's run-time LoRA endpoints, under its environment variable
    pooling_api.add_routes(app)  # --runner pooling's endpoints (vLLM's 400 on a generative model)
    _batch_api(app, replicas, config)
    responses_api.add_routes(app, open_store(config.responses_store, config.responses_store_size,
                                             config.responses_store_ttl))
    app.on_startup.append(_start_tokenizer)
    app.on_cleanup.append(_close_tokenizer)
    return app


def _batch_api(app: web.Application, replicas: ReplicaSet, config: RouterConfig) -> None:
    """The Batch API under --batch-dir (router.batch); without it, its endpoints say how to turn it on."""
    if config.batch_dir is None:
        async def off(request: web.Request) -> web.Response:
            raise bad_request("the Batch API is off on this server: start it with --batch-dir DIR")
        for path in ("/v1/files", "/v1/batches"):
            app.router.add_route("*", path, off)
            app.router.add_route("*", path + "/{tail:.*}", off)
        return
    from pathlib import Path

    from router.batch import api as batch_api
    from router.batch.files import FileStore
    from router.batch.runner import BatchRunner

    files = FileStore(Path(config.batch_dir), config.batch_max_file_bytes)
    runner = BatchRunner(files.root, files, config.batch_concurrency, replicas, config.tenants is not None)
    app[BATCH_CREDENTIAL] = runner.credential
    batch_api.add_routes(app, files, runner)


async def _start_tokenizer(app: web.Application) -> None:
    await app[TOKENIZER].start()  # the workers of requests' own chat templates, when they are trusted


async def _close_tokenizer(app: web.Application) -> None:
    await app[TOKENIZER].close()
