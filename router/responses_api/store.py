"""The responses the router keeps (store: true, OpenAI's default) for GET /v1/responses/{id} and for
previous_response_id, behind one asynchronous interface: this router's memory (router.responses_api.memory_store)
is its one backend so far."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

MEMORY = "memory"


@dataclass
class Stored:
    body: dict  # the Response object
    messages: list[dict]  # its conversation as chat messages, its own answer last (without instructions)


class ResponseStore(ABC):
    name: str  # what logs and errors call it

    @abstractmethod
    async def put(self, response_id: str, entry: Stored) -> None: ...

    @abstractmethod
    async def get(self, response_id: str) -> Stored | None: ...

    @abstractmethod
    async def delete(self, response_id: str) -> bool:
        """Whether there was such a response."""

    @abstractmethod
    def missing_hint(self) -> str:
        """Why a response may be missing besides store: false and DELETE, for the 404."""

    async def close(self) -> None:
        return None
