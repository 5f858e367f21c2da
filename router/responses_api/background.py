"""Background responses (background: true), as OpenAI's and vLLM's: the response is stored at once as queued,
then in_progress once its prompt is computed, then completed or incomplete (or failed, or cancelled); GET polls
it, POST .../cancel cancels it, and with stream: true its events are kept so that a client reconnects with GET
?stream=true&starting_after=N and reads on from event N + 1.

Everything lives in the response store (router.responses_api.store), so behind a shared Redis any router answers:
the body, the events, a cancel request (the router running the response sees it within WATCH_S and aborts), and
the lease of the router running it (renewed every WATCH_S, LEASE_S long). A router that finds a response still
running with no lease (its router died) takes it over: it attaches the request where its replica kept it
(router.resume: a background request is resumable, its replica keeps it --resume-grace-period seconds), rebuilds
the answer from its token ids and goes on from the events already kept, repeating none of their text.
"""
from __future__ import annotations

import asyncio
import json
import logging
import uuid
from dataclasses import dataclass

from aiohttp import web

from router.errors import APIError
from router.responses_api.output import ResponseBuilder
from router.responses_api.store import ResponseStore, Stored
from router.state import LIFECYCLE

log = logging.getLogger("stagemesh.router")
TERMINAL = ("completed", "incomplete", "failed", "cancelled")
LEASE_S = 5.0  # a running response's lease: another router takes it over this long after its router died
WATCH_S = 0.5  # how often the runner renews its lease and looks for a cancel
POLL_S = 0.1  # how often a stream reader looks for new events
RUNNING = web.AppKey("background_responses", dict)  # response id -> its task on this router
OWNER = web.AppKey("background_owner", str)  # this router, as a lease holder (new at every start)


@dataclass
class Job:
    """One background response as this router runs it."""
    store: ResponseStore
    builder: ResponseBuilder
    conversation: list[dict]  # what a later request continues: this one's messages, its answer to come
    job: dict  # the stored job: the request's body and id (Stored.job)
    owner: str  # the router running it (its lease's holder)
    status: str = "queued"

    @property
    def id(self) -> str:
        return self.builder.id

    async def save(self, body: dict, messages: list[dict] | None = None) -> None:
        await self.store.put(self.id, Stored(body, messages or [], self.job))

    async def emit(self, events: list[dict]) -> None:
        await self.store.append_events(self.id, [json.dumps(e, ensure_ascii=False) for e in events])


def init(app: web.Application) -> None:
    app[RUNNING], app[OWNER] = {}, uuid.uuid4().hex


def start(app: web.Application, job: Job, deltas, finish) -> None:
    """Run `job` here, its deltas consumed in a task of this router (counted as an active request, so that a
    drain waits for it); `finish(job)` gives the final (body, messages) to store."""
    task = asyncio.create_task(_run(app, job, deltas, finish))
    app[RUNNING][job.id] = task
    task.add_done_callback(lambda _: app[RUNNING].pop(job.id, None))


async def _run(app: web.Application, job: Job, deltas, finish) -> None:
    lifecycle = app[LIFECYCLE]
    lifecycle.active += 1
    consume = asyncio.create_task(_consume(job, deltas))
    watch = asyncio.create_task(_watch(job, consume))
    try:
        await _outcome(job, consume, finish)
    finally:
        watch.cancel()
        await asyncio.gather(watch, return_exceptions=True)
        await deltas.aclose()  # (an unfinished generation is aborted: its replica frees it)
        lifecycle.active -= 1


async def _consume(job: Job, deltas) -> None:
    b = job.builder
    async for _, d in deltas:
        if job.status == "queued":  # its prompt is computed: it runs
            job.status = "in_progress"
            snapshot = b.body("in_progress")
            await job.save(snapshot)
            await job.emit([b.event("response.in_progress", response=snapshot)])
        await job.emit(b.deltas(d))


async def _watch(job: Job, consume: asyncio.Task) -> None:
    """The lease renewed, and a cancel looked for, every WATCH_S (a store that fails now and then is retried)."""
    while not consume.done():
        try:
            await job.store.claim(job.id, job.owner, LEASE_S)
            if await job.store.cancel_requested(job.id):
                consume.cancel()
                return
        except APIError as err:
            log.warning("background response %s: the store did not answer (%s); trying again", job.id, err.message)
        await asyncio.sleep(WATCH_S)


async def _outcome(job: Job, consume: asyncio.Task, finish) -> None:
    """The stored end of the response: its final body and events, or failed (with the error), or cancelled."""
    b = job.builder
    try:
        await consume
    except asyncio.CancelledError:
        me = asyncio.current_task()
        if me is not None and me.cancelling():  # (this router is going away: another takes it over)
            raise
        await job.save(b.body("cancelled"))  # (the cancel call stored it already: kept so)
        log.info("background response %s cancelled", job.id)
        return
    except APIError as err:
        failed = {**b.body("failed"), "error": {"code": str(err.status), "message": err.message}}
        await job.save(failed)
        await job.emit([b.event("response.failed", response=failed)])
        log.info("background response %s failed: %s", job.id, err.message)
        return
    if await job.store.cancel_requested(job.id):  # (cancelled as it finished: it stays cancelled)
        return
    closing = b.closing()
    body, messages = finish(job)
    await job.save(body, messages)
    await job.emit(closing)


def restore(builder: ResponseBuilder, logged: list[str]) -> None:
    """A builder that takes over a response goes on after the events kept: their count, the items they opened
    (with their ids) and the text they sent; the reasoning they sent is not sent again (its done event has it
    whole)."""
    builder.sequence = len(logged)
    builder.quiet_reasoning = True
    for text in logged:
        event = json.loads(text)
        kind, item = event.get("type"), event.get("item") or {}
        if kind == "response.output_item.added" and item.get("type") == "message":
            builder.opened, builder.message_id = True, item["id"]
        elif kind == "response.output_item.added" and item.get("type") == "reasoning":
            builder.thinking, builder.reasoning_id = True, item["id"]
        elif kind == "response.reasoning_text.done":
            builder.thought = True
        elif kind == "response.output_text.delta":
            builder.sent += len(event.get("delta", ""))


async def events_stream(request: web.Request, store: ResponseStore, response_id: str, after: int,
                        take_over) -> web.StreamResponse:
    """A background response's events after number `after` (-1: all), as Server-Sent Events, as they are kept,
    until it ends; a response whose router died is taken over meanwhile (`take_over(entry)`)."""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    at = after + 1
    while True:
        events = await store.events(response_id, at)
        for text in events:
            kind = json.loads(text).get("type", "message")
            await resp.write(f"event: {kind}\ndata: {text}\n\n".encode())
        at += len(events)
        if events:
            continue
        entry = await store.get(response_id)
        if entry is None or entry.body.get("status") in TERMINAL:
            if not await store.events(response_id, at):  # (the last events are written after the status)
                return resp
            continue
        await take_over(entry)
        await asyncio.sleep(POLL_S)

