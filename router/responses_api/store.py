"""The responses the router keeps (store: true, OpenAI's default) for GET /v1/responses/{id} and for
previous_response_id: one interface (this module), two backends chosen by --responses-store
(router.responses_api.store_flags). `memory` (the default): this
router's own, the last --responses-store-size (router.responses_api.memory_store). A Redis URL: one server that
every router naming it shares, so that a response made on one router is found on another; each entry expires
after --responses-store-ttl seconds (router.responses_api.redis_store)."""
from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass

from router.errors import APIError

MEMORY = "memory"
REDIS_SCHEMES = ("redis://", "rediss://", "unix://")


@dataclass
class Stored:
    body: dict  # the Response object
    messages: list[dict]  # its conversation as chat messages, its own answer last (without instructions)
    # a background response: what any router needs to run it on (router.responses_api.background): the request's
    # body and id; None for the others
    job: dict | None = None

    def to_json(self) -> str:
        value = {"body": self.body, "messages": self.messages}
        if self.job is not None:
            value["job"] = self.job
        return json.dumps(value, ensure_ascii=False)

    @classmethod
    def from_json(cls, text: str | bytes) -> Stored:
        """An entry read back; ValueError when it is not one (another program's value under the key)."""
        value = json.loads(text)
        if not (isinstance(value, dict) and isinstance(value.get("body"), dict)
                and isinstance(value.get("messages"), list) and all(isinstance(m, dict) for m in value["messages"])):
            raise ValueError("not a stored response: a JSON object with 'body' (an object) and 'messages' expected")
        job = value.get("job")
        return cls(value["body"], value["messages"], job if isinstance(job, dict) else None)


class StoreUnavailable(APIError):
    """The store did not answer (down, unreachable, too slow, refused the command): a 503 naming it."""

    def __init__(self, store_name: str, reason: str):
        reason = reason.rstrip(". ")
        super().__init__(503, f"the Responses API's response store {store_name} (--responses-store) is unavailable: "
                              f"{reason}. Stored responses (previous_response_id, GET and DELETE /v1/responses/{{id}}) "
                              "need it; chat and completions do not", retry_after=1)
        self.reason = reason


class ResponseStore(ABC):
    name: str  # what logs and errors call it (a URL without its password)

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

    @abstractmethod
    def describe(self) -> str:
        """The store and its bound, for the router's start-up log."""

    # -- background responses (router.responses_api.background): their events, who runs them, their cancel ------
    @abstractmethod
    async def append_events(self, response_id: str, events: list[str]) -> None:
        """Add a background response's stream events (JSON texts), in order."""

    @abstractmethod
    async def events(self, response_id: str, start: int) -> list[str]:
        """Its events from index `start` on."""

    @abstractmethod
    async def claim(self, response_id: str, owner: str, ttl_s: float) -> bool:
        """Take (or keep) the lease on running it for `ttl_s` seconds: False while another owner holds it."""

    @abstractmethod
    async def request_cancel(self, response_id: str) -> None: ...

    @abstractmethod
    async def cancel_requested(self, response_id: str) -> bool: ...

    async def unreachable(self) -> str | None:
        """Why the store does not answer now (None: it does)."""
        return None

    async def close(self) -> None:
        return None

