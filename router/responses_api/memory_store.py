"""The response store in this router's memory (--responses-store memory, the default): the last
--responses-store-size responses, the oldest dropped first. Each router keeps its own: behind several routers,
a conversation's requests must reach the same one (or the routers share a Redis store)."""
from __future__ import annotations

from collections import OrderedDict

from router.responses_api.store import MEMORY, ResponseStore, Stored


class MemoryStore(ResponseStore):
    def __init__(self, max_entries: int):
        if max_entries < 1:
            raise ValueError("the response store holds at least one response")
        self.name = MEMORY
        self.max_entries = max_entries
        self._entries: OrderedDict[str, Stored] = OrderedDict()

    async def put(self, response_id: str, entry: Stored) -> None:
        self._entries[response_id] = entry
        self._entries.move_to_end(response_id)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    async def get(self, response_id: str) -> Stored | None:
        return self._entries.get(response_id)

    async def delete(self, response_id: str) -> bool:
        return self._entries.pop(response_id, None) is not None

    def missing_hint(self) -> str:
        return f"or is older than the last {self.max_entries} this router keeps (--responses-store-size)"

    def describe(self) -> str:
        return f"memory (this router's own: the last {self.max_entries} responses, --responses-store-size)"

    def __len__(self) -> int:
        return len(self._entries)
