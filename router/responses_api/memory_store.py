"""The response store in this router's memory (--responses-store memory, the default): the last
--responses-store-size responses, the oldest dropped first. Each router keeps its own: behind several routers,
a conversation's requests must reach the same one (or the routers share a Redis store)."""
from __future__ import annotations

import time
from collections import OrderedDict

from router.responses_api.store import MEMORY, ResponseStore, Stored


class MemoryStore(ResponseStore):
    def __init__(self, max_entries: int):
        if max_entries < 1:
            raise ValueError("the response store holds at least one response")
        self.name = MEMORY
        self.max_entries = max_entries
        self._entries: OrderedDict[str, Stored] = OrderedDict()
        self._events: dict[str, list[str]] = {}
        self._leases: dict[str, tuple[str, float]] = {}  # response id -> (owner, until: time.monotonic())
        self._cancels: set[str] = set()

    async def put(self, response_id: str, entry: Stored) -> None:
        self._entries[response_id] = entry
        self._entries.move_to_end(response_id)
        while len(self._entries) > self.max_entries:
            dropped, _ = self._entries.popitem(last=False)
            self._forget(dropped)

    async def get(self, response_id: str) -> Stored | None:
        return self._entries.get(response_id)

    async def delete(self, response_id: str) -> bool:
        self._forget(response_id)
        return self._entries.pop(response_id, None) is not None

    def _forget(self, response_id: str) -> None:
        self._events.pop(response_id, None)
        self._leases.pop(response_id, None)
        self._cancels.discard(response_id)

    async def append_events(self, response_id: str, events: list[str]) -> None:
        self._events.setdefault(response_id, []).extend(events)

    async def events(self, response_id: str, start: int) -> list[str]:
        return self._events.get(response_id, [])[start:]

    async def claim(self, response_id: str, owner: str, ttl_s: float) -> bool:
        held = self._leases.get(response_id)
        now = time.monotonic()
        if held is not None and held[0] != owner and held[1] > now:
            return False
        self._leases[response_id] = (owner, now + ttl_s)
        return True

    async def request_cancel(self, response_id: str) -> None:
        self._cancels.add(response_id)

    async def cancel_requested(self, response_id: str) -> bool:
        return response_id in self._cancels

    def missing_hint(self) -> str:
        return f"or is older than the last {self.max_entries} this router keeps (--responses-store-size)"

    def describe(self) -> str:
        return f"memory (this router's own: the last {self.max_entries} responses, --responses-store-size)"

    def __len__(self) -> int:
        return len(self._entries)
