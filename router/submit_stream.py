"""The router's end of one Scheduler.SubmitStream call: all of its requests to one replica share it.

Submits and aborts go out on the stream (those queued while a message was
being written travel together in the next one); the updates that come back,
all of a step's in one message, are handed to each request's queue. When the
stream breaks, every request on it fails with UNAVAILABLE naming the replica,
and the replica opens a new stream for the next request.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

import grpc

from stagemesh.core.engine_request import EngineRequest, KVSourceInfo
from stagemesh.core.step import TokenLogprob
from stagemesh.core.step_wire import logprob_from_pb
from stagemesh.core.wire import engine_request_to_pb, kv_source_from_pb
from stagemesh.v1 import scheduler_pb2, scheduler_pb2_grpc

log = logging.getLogger("stagemesh.router")
_CODES = {code.value[0]: code for code in grpc.StatusCode}


REASONS = {scheduler_pb2.FINISH_REASON_STOP: "stop", scheduler_pb2.FINISH_REASON_LENGTH: "length",
           scheduler_pb2.FINISH_REASON_ABORT: "abort", scheduler_pb2.FINISH_REASON_PREFILLED: "prefilled"}


@dataclass
class ReplicaOutput:
    """What a replica produced for a request since its last output (a SubmitResponse, decoded here)."""
    token_ids: list[int]
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "prefilled" (prefill_only: on to a decode replica)
    stop_token_id: int | None = None  # the stop or EOS token that ended it
    num_prompt_tokens: int = 0  # on the first output only
    num_cached_tokens: int = 0
    queue_seconds: float = 0.0  # arrival to first scheduling, on the first output
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # of prompt tokens from prompt_logprobs_start
    prompt_logprobs_start: int = 0
    kv_transfer: KVSourceInfo | None = None  # "prefilled": where the prompt's KV waits

    @classmethod
    def from_pb(cls, m: scheduler_pb2.SubmitResponse) -> "ReplicaOutput":
        return cls(list(m.token_ids), [logprob_from_pb(e) for e in m.logprobs], REASONS.get(m.finish_reason),
                   m.stop_token_id if m.HasField("stop_token_id") else None, m.num_prompt_tokens,
                   m.num_cached_tokens, m.queue_seconds, [logprob_from_pb(e) for e in m.prompt_logprobs],
                   m.prompt_logprobs_start,
                   kv_source_from_pb(m.kv_transfer) if m.HasField("kv_transfer") else None)


class RequestFailed(Exception):
    """A request failed on its replica, with the status of its RequestError."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(f"{code.name}: {details}")
        self.code, self.details = code, details


class RequestStream:
    """One request's outputs (ReplicaOutput) as they arrive; close() aborts it if unfinished."""

    def __init__(self, stream: SubmitStream, request_id: str, resumable: bool = False):
        self._stream, self.request_id, self.resumable = stream, request_id, resumable
        self._queue: asyncio.Queue = asyncio.Queue()  # RequestUpdate, or RequestFailed when the stream broke
        self._done = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> ReplicaOutput:
        if self._done:
            raise StopAsyncIteration
        update = await self._queue.get()
        if isinstance(update, RequestFailed):
            self._done = True
            raise update
        if update.HasField("error"):
            self._done = True
            raise RequestFailed(_CODES.get(update.error.code, grpc.StatusCode.UNKNOWN), update.error.message)
        self._done = bool(update.output.finish_reason)
        return ReplicaOutput.from_pb(update.output)

    def put(self, update) -> None:
        self._queue.put_nowait(update)

    def close(self) -> None:
        """The caller stops reading: a request still running is aborted in the scheduler."""
        if not self._done:
            self._done = True
            self._stream.abort(self.request_id)

    def release(self) -> None:
        """A resumable request's answer is written: its replica may forget what it kept of it."""
        if self.resumable:
            self._stream.release(self.request_id)


class SubmitStream:
    def __init__(self, stub: scheduler_pb2_grpc.SchedulerStub, address: str):
        self.address = address
        self.closed = False
        self.detaching = False  # the router stops: its requests are left to the replica, not aborted
        self._requests: dict[str, RequestStream] = {}  # submitted, not finished
        self._outbox = scheduler_pb2.SubmitStreamRequest()
        self._ready = asyncio.Event()
        # lives as long as the connection: no deadline (each request's own time is bounded by max_tokens)
        self._call = stub.SubmitStream(self._actions())
        self._reader = asyncio.create_task(self._read())

    def submit(self, request: EngineRequest) -> RequestStream:
        """Queue a request (whole: a continuation, either half of a disaggregated one, ...)."""
        stream = self._requests[request.request_id] = RequestStream(self, request.request_id, request.resumable)
        engine_request_to_pb(request, self._outbox.submits.add())
        self._ready.set()
        return stream

    def attach(self, request_id: str, prompt: list[int], owner: str) -> RequestStream:
        """Take over a resumable request another router submitted (for the same owner): its outputs so far
        come first."""
        stream = self._requests[request_id] = RequestStream(self, request_id, resumable=True)
        self._outbox.attaches.add(request_id=request_id, prompt_token_ids=prompt, owner=owner)
        self._ready.set()
        return stream

    def release(self, request_id: str) -> None:
        if not self.closed and not self.detaching:
            self._outbox.release_request_ids.append(request_id)
            self._ready.set()

    def abort(self, request_id: str) -> None:
        if self._requests.pop(request_id, None) is not None and not self.closed and not self.detaching:
            self._outbox.abort_request_ids.append(request_id)
            self._ready.set()

    def close(self) -> None:
        """End the stream: the scheduler aborts every request still running on it."""
        self.closed = True
        self._call.cancel()

    async def _actions(self):
        """What the call writes: everything queued since the previous message, as one message."""
        while True:
            await self._ready.wait()
            self._ready.clear()
            message, self._outbox = self._outbox, scheduler_pb2.SubmitStreamRequest()
            yield message

    async def _read(self) -> None:
        try:
            async for reply in self._call:
                self._hand_out(reply.updates)
            detail = "the scheduler ended the stream"
        except grpc.aio.AioRpcError as err:
            detail = f"{err.code().name}: {err.details()}"
        except asyncio.CancelledError:  # close(), or the channel closed under it
            detail = "the stream was cancelled"
        except Exception as err:  # a bug here must not leave the requests waiting forever
            log.exception("reading the stream to replica %s failed", self.address)
            detail = f"{type(err).__name__}: {err}"
        self._break(detail)

    def _hand_out(self, updates) -> None:
        requests = self._requests
        for update in updates:
            stream = requests.get(update.request_id)
            if stream is None:
                continue  # aborted here meanwhile
            if update.HasField("error") or update.output.finish_reason:
                del requests[update.request_id]
            stream.put(update)

    def _break(self, detail: str) -> None:
        self.closed = True
        requests, self._requests = self._requests, {}
        if requests:
            log.warning("the stream to replica %s broke (%s): %d request(s) fail", self.address, detail,
                        len(requests))
        message = f"the stream to replica {self.address} broke: {detail}"
        for stream in requests.values():
            stream.put(RequestFailed(grpc.StatusCode.UNAVAILABLE, message))
