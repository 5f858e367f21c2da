"""The requests of one multiplexed stream (a router's connection) and their outputs not yet written.

The step loop puts outputs without waiting; the stream's writer takes
everything pending at once and writes it as one message, so the outputs a step
produced for all of the connection's requests cost one stream write. Outputs of
one request that piled up behind a slow reader merge as in OutputStream.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass

from scheduler.output_stream import merged
from scheduler.request import RequestOutput


@dataclass(frozen=True)
class Rejected:
    """A request refused when it was submitted; the error says why (the service maps it to a status)."""
    request_id: str
    error: Exception


@dataclass(frozen=True)
class Update:
    item: RequestOutput | Rejected
    first: bool  # the request's first update on the stream (it carries the prompt figures)


class Connection:
    def __init__(self) -> None:
        self.running: set[str] = set()  # submitted on this connection and not finished
        self.closed = False  # the client's side ended: write what is pending, then stop
        self._fresh: set[str] = set()  # running, no update taken yet
        self._pending: dict[str, list[RequestOutput | Rejected]] = {}
        self._ready = asyncio.Event()

    def added(self, request_id: str) -> None:
        self.running.add(request_id)
        self._fresh.add(request_id)

    def put(self, out: RequestOutput) -> None:
        """An output of one of the connection's requests (the driver's sink interface)."""
        queue = self._pending.setdefault(out.request_id, [])
        last = queue[-1] if queue else None
        if isinstance(last, RequestOutput) and not last.finished and out.finish_reason != "error":
            queue[-1] = merged(last, out)
        else:  # an error comes on its own, after the tokens before it
            queue.append(out)
        if out.finished:
            self.running.discard(out.request_id)
        self._ready.set()

    def reject(self, request_id: str, error: Exception) -> None:
        self._pending.setdefault(request_id, []).append(Rejected(request_id, error))
        self._ready.set()

    def forget(self, request_id: str) -> None:
        """The client aborted the request: nothing more is written for it."""
        self.running.discard(request_id)
        self._fresh.discard(request_id)
        self._pending.pop(request_id, None)

    def close(self) -> None:
        self.closed = True
        self._ready.set()

    async def take(self) -> list[Update]:
        """Everything pending, once there is something (or the connection closed: then maybe nothing)."""
        await self._ready.wait()
        self._ready.clear()
        pending, self._pending = self._pending, {}
        updates = []
        for request_id, queue in pending.items():
            first = request_id in self._fresh
            self._fresh.discard(request_id)
            for item in queue:
                updates.append(Update(item, first))
                first = False
        return updates
