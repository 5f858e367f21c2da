"""The responses the router keeps (store: true, OpenAI's default) for GET /v1/responses/{id} and for
previous_response_id: the last N, in memory, the oldest dropped first (--responses-store-size). Each
router keeps its own: behind several routers, a conversation's requests must reach the same one."""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass
class Stored:
    body: dict  # the Response object
    messages: list[dict]  # its conversation as chat messages, its own answer last (without instructions)


class ResponseStore:
    def __init__(self, max_entries: int):
        if max_entries < 1:
            raise ValueError("the response store holds at least one response")
        self.max_entries = max_entries
        self._entries: OrderedDict[str, Stored] = OrderedDict()

    def put(self, response_id: str, entry: Stored) -> None:
        self._entries[response_id] = entry
        self._entries.move_to_end(response_id)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> Stored | None:
        return self._entries.get(response_id)

    def delete(self, response_id: str) -> bool:
        return self._entries.pop(response_id, None) is not None

    def __len__(self) -> int:
        return len(self._entries)
