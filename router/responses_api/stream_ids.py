"""A Responses stream's event ids, and what a resumed stream leaves out (router.resume does the same for chat
and completions streams; docs/operations.md says why ids are opt-in).

The events come in groups: the opening (response.created, response.in_progress), one group per delta of the
generation (the message item's opening and a text delta), and the closing (the rest of the text, the items'
ends, the finished response). An event's id says what the client has once it has read it:

    T/S       the tokens the stream covers (T) and the event's sequence_number (S): the last event of its group
    Tf/S      the same, for the stream's last event (the client has everything)
    B/F/J     an event before the last of its group: the tokens before the group (B), the group's first
              sequence number (F) and the event's place in it (J)

A resume (Last-Event-ID, the same request and X-Request-Id) attaches the request where it runs (router.dispatch)
with the client's B or T tokens as what it has; the groups those tokens cover are rebuilt without being written
(the text, the items' state), and the stream goes on numbered from where the client stopped: nothing repeated,
nothing missing. (What the replica generated while no router streamed it comes as one text delta, so the
numbers after a resume run on from the client's last one, not as the undisturbed stream's would.)
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

from router.errors import bad_request
from router.resume import HEADER, MAX_ID_CHARS, ResumePoint

_ID = re.compile(r"(\d{1,7})(f?)/(\d{1,7})(?:/(\d{1,3}))?")
Events = list[dict]


@dataclass
class Point:
    """Where a resuming client stopped: tokens it has, and the sequence number to go on from (last form), or the
    group it has part of (partial form: its first sequence number and how many of its events it has)."""
    tokens: int
    finished: bool
    seq: int  # last form: the next event's number; partial: the group's first
    have: int = 0  # partial: events of that group the client has (0: last form)

    @classmethod
    def parse(cls, value: str) -> "Point":
        match = _ID.fullmatch(value.strip()) if len(value) <= MAX_ID_CHARS else None
        if match is None:
            raise bad_request(f"{HEADER} {value[:80]!r} is not an event id this server sent", HEADER)
        tokens, finished, seq, place = match.groups()
        if place is None:
            return cls(int(tokens), bool(finished), int(seq) + 1)
        if finished:
            raise bad_request(f"{HEADER} {value[:80]!r} is not an event id this server sent", HEADER)
        return cls(int(tokens), False, int(seq), int(place) + 1)

    def resume_point(self) -> ResumePoint:
        """What the generation resumes from (router.dispatch attaches it there)."""
        return ResumePoint([self.tokens], [self.finished])


class ResponseEventIds:
    """Ids for a stream's events (None each when not `enabled`); with a resume point, which to leave out."""

    def __init__(self, enabled: bool, point: Point | None = None):
        self.enabled, self.point = enabled, point
        self.tokens = 0

    def opening(self, builder, make: Callable[[], Events]) -> list[tuple[str | None, dict]]:
        p = self.point
        partial = p is not None and p.have and p.seq == 0  # (the opening is the only group numbered from 0)
        return self._group(builder, make, 0, replayed=p is not None and not partial, last=False)

    def delta(self, builder, make: Callable[[], Events], num_tokens: int) -> list[tuple[str | None, dict]]:
        p = self.point
        return self._group(builder, make, num_tokens, replayed=p is not None and self.tokens + num_tokens <= p.tokens,
                           last=False)

    def closing(self, builder, make: Callable[[], Events]) -> list[tuple[str | None, dict]]:
        p = self.point
        return self._group(builder, make, 0, replayed=p is not None and p.finished, last=True)

    def _group(self, builder, make: Callable[[], Events], num_tokens: int, replayed: bool, last: bool
               ) -> list[tuple[str | None, dict]]:
        """The group's events (made either way: they carry the builder's state on), with their ids; those the
        client has are left out."""
        before, p = self.tokens, self.point
        self.tokens += num_tokens
        if replayed:
            make()
            return []
        skip = 0
        if p is not None:  # the first group the client lacks (some of): numbered from where it stopped
            builder.sequence, skip, self.point = p.seq, p.have, None
        events = make()
        out = []
        for j, event in enumerate(events):
            if j == len(events) - 1:
                value = f"{self.tokens}{'f' if last else ''}/{event['sequence_number']}"
            else:
                value = f"{before}/{events[0]['sequence_number']}/{j}"
            if j >= skip:
                out.append((value if self.enabled else None, event))
        return out
