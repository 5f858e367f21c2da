"""The Responses API's endpoints, as vLLM serves them: POST /v1/responses (whole or streamed as Server-Sent
Events `event: <type>` / `data: <json>`, with no [DONE]), GET and DELETE /v1/responses/{id} over the store,
and POST /v1/responses/{id}/cancel (only background responses can be cancelled, and there are none).

A store: true response that the store fails to keep is still answered (its generation is not thrown away),
with "store": false in it, as vLLM answers when it keeps nothing, and a warning in the log; the calls that
read the store (previous_response_id, GET, DELETE) answer 503 naming it while it is down."""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
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
from router.responses_api.output import ResponseBuilder
from router.responses_api.request import NEUTRAL, REFUSED, ResponsesRequest, chat_body, renamed
from router.responses_api.store import ResponseStore, Stored, StoreUnavailable
from router.responses_api.stream_ids import Point, ResponseEventIds
from router.state import CONFIG, REPLICAS, TOKENIZER, request_id, resumable

STORE = web.AppKey("responses_store", ResponseStore)
log = logging.getLogger("stagemesh.router")


def add_routes(app: web.Application, store: ResponseStore) -> None:
    app[STORE] = store
    app.on_cleanup.append(lambda _: store.close())
    app.router.add_post("/v1/responses", create)
    app.router.add_get("/v1/responses/{response_id}", retrieve)
    app.router.add_delete("/v1/responses/{response_id}", delete)
    app.router.add_post("/v1/responses/{response_id}/cancel", cancel)


async def create(request: web.Request) -> web.StreamResponse:
    m = validate(ResponsesRequest, await read_json(request), REFUSED, NEUTRAL)
    store = request.app[STORE]
    history = []
    if m.previous_response_id is not None:
        history = (await _stored(store, m.previous_response_id, "previous_response_id")).messages
    chat, origins = chat_body(m, history)
    try:
        req, base, gens, ids = await _prepare(request, chat, m.stream)
    except APIError as err:
        raise renamed(err, origins) from None
    builder = ResponseBuilder(m, req, f"resp_{base}", int(time.time()), gens[0], request.app[TOKENIZER])
    # what a later request continues: this one's messages (not its instructions) and its answer
    conversation = chat["messages"][1:] if m.instructions else chat["messages"]
    deltas = choices.run(req, gens, request.app[REPLICAS], request.app[TOKENIZER])
    headers = {"X-Request-Id": base}
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


async def _remember(store: ResponseStore, m: ResponsesRequest, builder: ResponseBuilder,
                    conversation: list[dict]) -> None:
    """Keeps a store: true response; when the store fails, the response says "store": false instead."""
    if not m.store:
        return
    turn = builder.turn()
    assert builder.req.chat_options is not None  # (a Responses request is a chat)
    if builder.req.chat_options.continue_final_message:  # the answer went on with the last (partial) message
        last, conversation = conversation[-1], conversation[:-1]
        turn = {**turn, "content": (last["content"] or "") + (turn["content"] or "")}
    try:
        await store.put(builder.id, Stored(builder.body(), [*conversation, turn]))
    except StoreUnavailable as err:
        builder.stored = False
        log.warning("response %s is answered unstored (\"store\": false): %s", builder.id, err.message)


async def _prepare(request: web.Request, chat: dict, stream: bool
                   ) -> tuple[GenerateRequest, str, list[Generation], ResponseEventIds]:
    """The chat path: the request checked and built, admitted (or attached where it runs, for a resume), its
    prompt rendered and tokenized; its stream's event ids."""
    config = request.app[CONFIG]
    req = chat_request(validate(ChatCompletionRequest, chat), config)
    base = request_id(request, req)
    ids = _event_ids(request, req, stream)
    _, gens = await launch(req, request.app[REPLICAS], request.app[TOKENIZER], config.max_model_len, f"resp_{base}")
    return req, base, gens, ids


def _event_ids(request: web.Request, req: GenerateRequest, stream: bool) -> ResponseEventIds:
    """As chat and completions streams (router.state.resumable): event ids for a client that accepts event
    streams, and with Last-Event-ID a resume of the stream it had."""
    last = resumable(request, req, stream)
    if last is None:
        return ResponseEventIds(req.resumable)
    point = Point.parse(last)
    req.resume = point.resume_point()
    return ResponseEventIds(True, point)


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


def _no_query(request: web.Request) -> None:
    for name, value in request.query.items():
        if not (name == "stream" and value.lower() == "false"):
            raise bad_request(f"'{name}' is not supported by this server here: it keeps no stream events, only "
                              "the finished response", name)


async def retrieve(request: web.Request) -> web.Response:
    _no_query(request)
    return web.json_response((await _stored(request.app[STORE], request.match_info["response_id"])).body)


async def delete(request: web.Request) -> web.Response:
    response_id = request.match_info["response_id"]
    if not await request.app[STORE].delete(response_id):
        raise _not_found(request.app[STORE], response_id)
    return web.json_response({"id": response_id, "object": "response", "deleted": True})


async def cancel(request: web.Request) -> web.Response:
    await _stored(request.app[STORE], request.match_info["response_id"])
    raise bad_request("Cannot cancel a synchronous response: only background responses can be cancelled, and "
                      "this server runs none")
