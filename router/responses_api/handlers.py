"""The Responses API's endpoints, as vLLM serves them: POST /v1/responses (whole or streamed as Server-Sent
Events `event: <type>` / `data: <json>`, with no [DONE]), GET and DELETE /v1/responses/{id} over the store,
and POST /v1/responses/{id}/cancel (a background response's: router.responses_api.background).

A store: true response that the store fails to keep is still answered (its generation is not thrown away),
with "store": false in it, as vLLM answers when it keeps nothing, and a warning in the log; the calls that
read the store (previous_response_id, GET, DELETE) answer 503 naming it while it is down."""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import replace
from functools import partial

from aiohttp import web

from router import choices
from router.admission import launch
from router.errors import APIError, bad_request
from router.dispatch import Generation
from router.http_body import read_json
from router.openai_request import chat_request
from router.protocol import ChatCompletionRequest, validate
from router.request import GenerateRequest
from router.resume import ResumePoint
from router.responses_api import background
from router.responses_api.output import ResponseBuilder
from router.responses_api.request import NEUTRAL, REFUSED, ResponsesRequest, chat_body, renamed
from router.responses_api.store import ResponseStore, Stored, StoreUnavailable
from router.responses_api.stream_ids import Point, ResponseEventIds
from router.state import CONFIG, REPLICAS, TOKENIZER, request_id, resumable

STORE = web.AppKey("responses_store", ResponseStore)
log = logging.getLogger("stagemesh.router")


def add_routes(app: web.Application, store: ResponseStore) -> None:
    app[STORE] = store
    background.init(app)
    app.on_cleanup.append(lambda _: store.close())
    app.router.add_post("/v1/responses", create)
    app.router.add_get("/v1/responses/{response_id}", retrieve)
    app.router.add_delete("/v1/responses/{response_id}", delete)
    app.router.add_post("/v1/responses/{response_id}/cancel", cancel)


async def create(request: web.Request) -> web.StreamResponse:
    if request.app[CONFIG].pooler is not None:  # (--runner pooling: vLLM's 400)
        raise bad_request("The model does not support Responses API")
    raw = await read_json(request)
    m = validate(ResponsesRequest, raw, REFUSED, NEUTRAL)
    if m.background and not m.store:  # (vLLM's words)
        raise bad_request("background can only be used when `store` is true", "background")
    store = request.app[STORE]
    chat, origins = await _chat(store, m)
    try:
        req = chat_request(validate(ChatCompletionRequest, chat), request.app[CONFIG])
        base = request_id(request, req)
        ids = _event_ids(request, req, m.stream, m.background)
        gens = await _launch(request.app, req, base)
    except APIError as err:
        raise renamed(err, origins) from None
    builder = ResponseBuilder(m, req, f"resp_{base}", int(time.time()), gens[0], request.app[TOKENIZER])
    conversation = _conversation(m, chat)
    deltas = choices.run(req, gens, request.app[REPLICAS], request.app[TOKENIZER])
    headers = {"X-Request-Id": base, **req.rate_headers}
    if m.background:
        # client: whom it belongs to, for a take-over's resume: its tenant's owner (router.admission stamped it on
        # req.engine in launch), else a digest of its client's credential
        run = {"request": raw, "request_id": base, "client": req.engine.owner}
        job = background.Job(store, builder, conversation, run, request.app[background.OWNER])
        return await _in_background(request, job, deltas, headers)
    try:  # closing it cancels the generation, so the scheduler aborts it and frees its blocks
        if not m.stream:
            async for _, d in deltas:
                builder.add(d)
            await _remember(store, m, builder, conversation)
            return web.json_response(builder.body(), headers=headers)
        return await _stream(request, builder, deltas, headers, lambda: _remember(store, m, builder, conversation),
                             ids)
    finally:
        await deltas.aclose()


async def _chat(store: ResponseStore, m: ResponsesRequest) -> tuple[dict, list[str]]:
    """The chat body the request asks for, after the conversation it continues (previous_response_id)."""
    history = []
    if m.previous_response_id is not None:
        history = (await _stored(store, m.previous_response_id, "previous_response_id")).messages
    return chat_body(m, history)


def _conversation(m: ResponsesRequest, chat: dict) -> list[dict]:
    """What a later request continues: this one's messages (not its instructions), before its answer."""
    return chat["messages"][1:] if m.instructions else chat["messages"]


async def _launch(app: web.Application, req: GenerateRequest, base: str) -> list[Generation]:
    """The chat path: the request admitted (or attached where it runs, for a resume), its prompt rendered and
    tokenized."""
    _, gens = await launch(req, app[REPLICAS], app[TOKENIZER], app[CONFIG], f"resp_{base}")
    return gens


def _event_ids(request: web.Request, req: GenerateRequest, stream: bool, background_run: bool) -> ResponseEventIds:
    """As chat and completions streams (router.state.resumable): event ids for a client that accepts event
    streams, and with Last-Event-ID a resume of the stream it had. A background response is resumable whatever
    its client accepts (its replica keeps it if this router dies, for the router that takes it over); its stream
    is read again with GET's starting_after, not Last-Event-ID."""
    last = resumable(request, req, stream)
    if background_run:
        if last is not None:
            raise bad_request("a background response's stream is read again with GET /v1/responses/{id}?stream=true"
                              "&starting_after=N, not with Last-Event-ID", "Last-Event-ID")
        req.resumable = True
        return ResponseEventIds(False)
    if last is None:
        return ResponseEventIds(req.resumable)
    point = Point.parse(last)
    req.resume = point.resume_point()
    return ResponseEventIds(True, point)


def _final(builder: ResponseBuilder, conversation: list[dict]) -> tuple[dict, list[dict]]:
    """The finished response and the conversation a later request continues, its answer last."""
    turn = builder.turn()
    assert builder.req.chat_options is not None  # (a Responses request is a chat)
    if builder.req.chat_options.continue_final_message:  # the answer went on with the last (partial) message
        last, conversation = conversation[-1], conversation[:-1]
        turn = {**turn, "content": (last["content"] or "") + (turn["content"] or "")}
    return builder.body(), [*conversation, turn]


async def _remember(store: ResponseStore, m: ResponsesRequest, builder: ResponseBuilder,
                    conversation: list[dict]) -> None:
    """Keeps a store: true response; when the store fails, the response says "store": false instead."""
    if not m.store:
        return
    body, messages = _final(builder, conversation)
    try:
        await store.put(builder.id, Stored(body, messages))
    except StoreUnavailable as err:
        builder.stored = False
        log.warning("response %s is answered unstored (\"store\": false): %s", builder.id, err.message)


async def _in_background(request: web.Request, job: background.Job, deltas, headers: dict[str, str]
                         ) -> web.StreamResponse:
    """Stored as queued (a background response needs its store: 503 without it), run in a task of this router;
    answered at once, or as its events' stream."""
    b = job.builder
    queued = b.body("queued")
    try:
        await job.save(queued)
        await job.emit([b.event("response.created", response=queued)])
        await job.store.claim(job.id, job.owner, background.LEASE_S)
    except BaseException:
        await deltas.aclose()
        raise
    background.start(request.app, job, deltas, lambda j: _final(j.builder, j.conversation))
    if b.m.stream:
        return await background.events_stream(request, job.store, job.id, -1, _taker(request.app))
    return web.json_response(queued, headers=headers)


def _taker(app: web.Application):
    async def take_over(entry: Stored) -> None:
        await _take_over(app, entry)
    return take_over


async def _take_over(app: web.Application, entry: Stored) -> None:
    """Run a background response whose router died (its lease expired) here: its request attached where its
    replica kept it, its events going on from those kept. One that cannot be attached fails, with why."""
    store, rid = app[STORE], entry.body.get("id", "")
    if entry.job is None or entry.body.get("status") in background.TERMINAL or rid in app[background.RUNNING]:
        return
    if not await store.claim(rid, app[background.OWNER], background.LEASE_S):
        return
    log.info("background response %s: its router stopped running it; taking it over", rid)
    m = validate(ResponsesRequest, entry.job["request"], REFUSED, NEUTRAL)
    try:
        chat, _ = await _chat(store, m)
        req = chat_request(validate(ChatCompletionRequest, chat), app[CONFIG])
        req.resumable, req.resume = True, ResumePoint([0], [False])  # an attach, as its first client
        req.engine = replace(req.engine, owner=entry.job.get("client", ""))
        gens = await _launch(app, req, entry.job["request_id"])
    except APIError as err:
        await store.put(rid, Stored({**entry.body, "status": "failed", "error": {
            "code": str(err.status), "message": f"its router stopped and it could not be taken over: {err.message}"}},
            [], entry.job))
        return
    builder = ResponseBuilder(m, req, rid, entry.body.get("created_at", int(time.time())), gens[0], app[TOKENIZER])
    background.restore(builder, await store.events(rid, 0))
    job = background.Job(store, builder, _conversation(m, chat), entry.job, app[background.OWNER],
                         status=entry.body["status"])
    background.start(app, job, choices.run(req, gens, app[REPLICAS], app[TOKENIZER]),
                     lambda j: _final(j.builder, j.conversation))


async def _stream(request, builder: ResponseBuilder, deltas, headers, finished,
                  ids: ResponseEventIds) -> web.StreamResponse:
    """The events, each with its id when the client asked for them (stream_ids); a resume writes only what its
    client lacks."""
    first = await anext(deltas, None)  # errors before the first output still get an HTTP status
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", **headers})
    await resp.prepare(request)
    try:
        await _write(resp, ids.opening(builder, builder.opening))
        item = first
        while item is not None:
            await _write(resp, ids.delta(builder, partial(builder.deltas, item[1]), len(item[1].token_ids)))
            item = await anext(deltas, None)
        await finished()  # before the closing events: the last one says whether the response was stored
        await _write(resp, ids.closing(builder, builder.closing))
    except APIError as err:
        await _write(resp, [(None, _error_event(builder, err))])
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:  # the status line is sent: the error goes in the stream, as an error event
        incident = uuid.uuid4().hex[:12]
        log.exception("unexpected error while streaming %s (incident %s)", builder.id, incident)
        await _write(resp, [(None, _error_event(builder, APIError(500, f"internal error (incident {incident})")))])
    return resp


async def _write(resp: web.StreamResponse, events: list[tuple[str | None, dict]]) -> None:
    for event_id, event in events:
        head = f"id: {event_id}\n" if event_id is not None else ""
        await resp.write(f"{head}event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n".encode())


def _error_event(builder: ResponseBuilder, err: APIError) -> dict:
    error = err.body()["error"]
    return builder.event("error", code=error["code"], message=error["message"], param=error["param"])


async def _stored(store: ResponseStore, response_id: str, param: str | None = None) -> Stored:
    entry = await store.get(response_id)
    if entry is None:
        raise _not_found(store, response_id, param)
    return entry


def _not_found(store: ResponseStore, response_id: str, param: str | None = None) -> APIError:
    return APIError(404, f"Response with id '{response_id}' not found: it was not stored (store: false), was "
                         f"deleted, {store.missing_hint()}", param)


def _stream_query(request: web.Request, entry: Stored) -> int | None:
    """GET's stream=true and starting_after N (a background response's events after number N: -1, all), or None
    for the response itself."""
    query = dict(request.query)
    stream = query.pop("stream", "false").lower()
    after = query.pop("starting_after", None)
    for name in query:
        raise bad_request(f"'{name}' is not supported by this server here", name)
    if stream not in ("true", "false"):
        raise bad_request("'stream' must be true or false", "stream")
    if stream == "false":
        if after is not None:
            raise bad_request("'starting_after' goes with stream=true", "starting_after")
        return None
    if entry.job is None:  # (only a background response keeps its events)
        raise bad_request("only a background response can be streamed again: this one kept no stream events",
                          "stream")
    if after is not None and not after.lstrip("-").isdigit():
        raise bad_request("'starting_after' must be an event's sequence_number", "starting_after")
    return -1 if after is None else max(-1, int(after))


async def retrieve(request: web.Request) -> web.StreamResponse:
    store, rid = request.app[STORE], request.match_info["response_id"]
    entry = await _stored(store, rid)
    after = _stream_query(request, entry)
    await _take_over(request.app, entry)
    if after is not None:
        return await background.events_stream(request, store, rid, after, _taker(request.app))
    return web.json_response(entry.body)


async def delete(request: web.Request) -> web.Response:
    response_id = request.match_info["response_id"]
    if not await request.app[STORE].delete(response_id):
        raise _not_found(request.app[STORE], response_id)
    return web.json_response({"id": response_id, "object": "response", "deleted": True})


async def cancel(request: web.Request) -> web.Response:
    """A queued or running background response: cancelled (the router running it aborts its request within
    background.WATCH_S), answered with its cancelled body; anything else is vLLM's 400."""
    store, rid = request.app[STORE], request.match_info["response_id"]
    entry = await _stored(store, rid)
    if entry.job is None or entry.body.get("status") not in ("queued", "in_progress"):
        raise bad_request("Cannot cancel a synchronous response.")
    await store.request_cancel(rid)
    body = {**entry.body, "status": "cancelled"}
    await store.put(rid, Stored(body, entry.messages, entry.job))
    task = request.app[background.RUNNING].get(rid)
    if task is not None:  # (here: its request is aborted before the answer)
        await asyncio.wait([task], timeout=background.LEASE_S)
    return web.json_response(body)
