"""Streams that outlive their router: SSE event ids, and a resume from a client's Last-Event-ID.

A client that asks for a resumable stream (it accepts `text/event-stream`, as SSE clients say) gets an `id:`
on every event. The id says what the client has once it has read the event: per choice the tokens covered
and whether the choice finished (`12`, `12f`; choices joined by commas), and for an event that is not the last
one of its delta the delta's start and the event's place in it (`12,7/1/0`: choice 1's delta after 12 and 7
tokens, its first event). If the router goes away, the client sends the same request, with the same
X-Request-Id, to any router, with `Last-Event-ID`: that router attaches the request where its replica kept it
(scheduler.sessions), replays the choices' tokens up to that point without writing them (the text, stop strings
and tool-call state are rebuilt from the token ids), and writes the rest: nothing repeated, nothing missing.

Why opt-in: a stream's `id:` lines break clients that read an event as `data: <json>` and nothing else (vLLM's
own `vllm bench serve` does), so only clients that accept event streams get them.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TypeVar

from router.errors import bad_request

HEADER = "Last-Event-ID"
MAX_ID_CHARS = 4096
E = TypeVar("E")  # an event: a chunk dict (HTTP) or a Delta (gRPC)
_ID = re.compile(r"(\d{1,7}f?(?:,\d{1,7}f?)*)(?:/(?:(\d{1,4})/(\d{1,3})|(usage)|(done)|(error)))?")


def wants_event_ids(accept: str) -> bool:
    """Whether a client's Accept header asks for event streams by name (not merely */*)."""
    return "text/event-stream" in accept.lower()


@dataclass
class ResumePoint:
    """What a resuming client has: per choice the tokens covered and whether it finished; the events it has of
    a delta it did not finish reading (choice, events); whether it has the usage event."""
    tokens: list[int]
    finished: list[bool]
    partial: tuple[int, int] | None = None
    has_usage: bool = False

    @classmethod
    def parse(cls, value: str, num_choices: int) -> "ResumePoint":
        match = _ID.fullmatch(value.strip()) if len(value) <= MAX_ID_CHARS else None
        if match is None:
            raise bad_request(f"{HEADER} {value[:80]!r} is not an event id this server sent", HEADER)
        counts, choice, events, usage, done, _ = match.groups()
        tokens = [int(c.rstrip("f")) for c in counts.split(",")]
        if len(tokens) != num_choices:
            raise bad_request(f"{HEADER} {value[:80]!r} has {len(tokens)} choice(s), the request {num_choices}", HEADER)
        point = cls(tokens, [c.endswith("f") for c in counts.split(",")], has_usage=bool(usage or done))
        if choice is not None:
            if int(choice) >= num_choices or point.finished[int(choice)]:
                raise bad_request(f"{HEADER} {value[:80]!r} names a choice that is not open", HEADER)
            point.partial = (int(choice), int(events))
        return point

    @classmethod
    def of_progress(cls, progress: list[tuple[int, bool]]) -> "ResumePoint":
        """The gRPC frontend's resume: (tokens, finished) per choice."""
        return cls([t for t, _ in progress], [f for _, f in progress])


def _fmt(tokens: list[int], finished: list[bool]) -> str:
    return ",".join(f"{t}{'f' if f else ''}" for t, f in zip(tokens, finished))


@dataclass
class EventIds:
    """The ids of a stream's events (None each when not `enabled`: a client that did not ask for them), and
    which of them a resumed stream does not write again."""
    num_choices: int
    resume: ResumePoint | None = None
    enabled: bool = True
    tokens: list[int] = field(init=False)
    finished: list[bool] = field(init=False)

    def __post_init__(self) -> None:
        self.tokens, self.finished = [0] * self.num_choices, [False] * self.num_choices

    def delta(self, choice: int, num_tokens: int, finishes: bool, events: list[E]) -> list[tuple[str | None, E]]:
        """(id, event) of a delta's events that go out; the delta covers `num_tokens` more of `choice`."""
        before = _fmt(self.tokens, self.finished)
        start = self.tokens[choice]
        self.tokens[choice] += num_tokens
        self.finished[choice] = self.finished[choice] or finishes
        after = _fmt(self.tokens, self.finished)
        skip = self._skipped(choice, start, finishes, len(events))
        return [(self._id(after if j == len(events) - 1 else f"{before}/{choice}/{j}"), event)
                for j, event in enumerate(events) if j >= skip]

    def _id(self, value: str) -> str | None:
        return value if self.enabled else None

    def _skipped(self, choice: int, start: int, finishes: bool, num_events: int) -> int:
        """How many of a delta's first events the client has."""
        r = self.resume
        if r is None:
            return 0
        if r.finished[choice]:
            return num_events
        end, had = self.tokens[choice], r.tokens[choice]
        if end < had or (end == had and not finishes):
            return num_events  # replayed: the client has it
        if r.partial is not None and r.partial[0] == choice and start == had:
            skip, r.partial = r.partial[1] + 1, None
            return skip
        return 0

    @property
    def usage_due(self) -> bool:
        """Whether the usage event goes out (the client of a resume may have it)."""
        return self.resume is None or not self.resume.has_usage

    def usage(self) -> str | None:
        return self._id(f"{self._now()}/usage")

    def done(self) -> str | None:
        return self._id(f"{self._now()}/done")

    def error(self) -> str | None:
        return self._id(f"{self._now()}/error")

    def _now(self) -> str:
        return _fmt(self.tokens, self.finished)
