"""A tenant's limits at the router (router.tenants): requests_per_minute and tokens_per_minute give a 429 with
Retry-After and OpenAI's x-ratelimit-* headers, max_concurrency a 429 while that many of its requests run.

The per-minute counts are a sliding window (this minute's count plus the last minute's, weighed by what is left
of it), kept by the router (RateWindows) or, when the routers share a Redis store (--responses-store
redis://...), in Redis (router.limits_redis), so that a limit holds across every router that names it. A
request's tokens are its prompt's plus max_tokens for each choice (what it may use, as OpenAI counts); a pooling
request's (router.pooling_api) its prompt's, as its usage. A count is taken, then given back if it passes the
limit: two routers racing at the limit may both refuse, never both pass. max_concurrency counts a tenant's
requests in flight (Slots): this router's, or, in the shared Redis store, every router's, each request holding a
lease that its router renews while it runs (a router that dies frees its leases when they lapse).
"""
from __future__ import annotations

import logging
import math
import time
from abc import ABC, abstractmethod
from collections import Counter
from dataclasses import dataclass

from router.errors import APIError
from router.observe import tenant_refused
from router.tenants import Tenant

log = logging.getLogger("stagemesh.router")
WINDOW_S = 60.0


@dataclass(frozen=True)
class Verdict:
    ok: bool
    limit: int
    remaining: int  # after this request (ok) or now (refused)
    reset_s: float  # until the window has room for it again (refused) or is empty (ok)


def window_count(previous: int, current: int, now: float) -> float:
    """The sliding window's count: this minute's, plus the last minute's in proportion to what is left of it."""
    elapsed = now % WINDOW_S
    return previous * (WINDOW_S - elapsed) / WINDOW_S + current


def verdict(previous: int, current: int, amount: int, limit: int, now: float) -> Verdict:
    """Whether `amount` more fits, given the window's counts with it taken (current includes it)."""
    count = window_count(previous, current, now)
    elapsed = now % WINDOW_S
    if count <= limit:  # (this minute's count weighs on the window until the next one ends)
        return Verdict(True, limit, int(limit - count), 2 * WINDOW_S - elapsed)
    before = count - amount
    if current > limit:  # this minute alone is past it: the next one
        reset = WINDOW_S - elapsed
    else:  # the last minute's share decays by previous / WINDOW_S per second
        reset = (count - limit) * WINDOW_S / previous if previous else WINDOW_S - elapsed
    return Verdict(False, limit, max(int(limit - before), 0), max(reset, 1.0))


class RateWindows(ABC):
    """The per-minute counts of (tenant, kind): this router's own, or shared (router.limits_redis)."""

    @abstractmethod
    async def take(self, key: str, amount: int, limit: int) -> Verdict:
        """Count `amount` against `limit` in the window; given back when it does not fit."""

    def describe(self) -> str:
        return "this router's memory (each router counts apart)"

    async def close(self) -> None:
        return None


class MemoryWindows(RateWindows):
    def __init__(self, clock=time.time):
        self.clock = clock
        self._counts: dict[str, tuple[int, int, int]] = {}  # key -> (minute, previous, current)

    async def take(self, key: str, amount: int, limit: int) -> Verdict:
        now = self.clock()
        minute = int(now // WINDOW_S)
        was, previous, current = self._counts.get(key, (minute, 0, 0))
        if was != minute:
            previous, current = (current if was == minute - 1 else 0), 0
        current += amount
        v = verdict(previous, current, amount, limit, now)
        self._counts[key] = (minute, previous, current if v.ok else current - amount)
        return v


class Slots(ABC):
    """A tenant's requests in flight, counted against its max_concurrency: this router's or shared."""

    @abstractmethod
    async def enter(self, key: str, limit: int) -> str | None:
        """A place for one more request of `key` under `limit`: a ticket to leave with, None when full."""

    @abstractmethod
    async def leave(self, key: str, ticket: str) -> None:
        """The request holding `ticket` ended."""

    async def close(self) -> None:
        return None


class MemorySlots(Slots):
    def __init__(self):
        self.running: Counter[str] = Counter()  # this router's requests in flight, per key

    async def enter(self, key: str, limit: int) -> str | None:
        if self.running[key] >= limit:
            return None
        self.running[key] += 1
        return key

    async def leave(self, key: str, ticket: str) -> None:
        self.running[key] -= 1
        if self.running[key] <= 0:
            del self.running[key]


class TenantLimits:
    """Every tenant's limits, counted: admit() before a request runs, then enter() / leave() around it."""

    def __init__(self, windows: RateWindows, slots: Slots | None = None):
        self.windows, self.slots = windows, slots or MemorySlots()

    async def admit(self, tenant: Tenant, num_tokens: int) -> dict[str, str]:
        """Count the request against its tenant's per-minute limits: OpenAI's x-ratelimit-* headers for its
        answer, or the 429 (with them and Retry-After) when it passes one."""
        headers: dict[str, str] = {}
        for kind, limit, amount in (("requests", tenant.requests_per_minute, 1),
                                    ("tokens", tenant.tokens_per_minute, num_tokens)):
            if limit is None:
                continue
            v = await self.windows.take(f"{tenant.name}:{kind}", amount, limit)
            headers.update(_headers(kind, v))
            if not v.ok:
                tenant_refused(tenant.name, 429, f"{kind}_per_minute")
                raise APIError(429, f"tenant {tenant.name!r} is over its {kind}_per_minute ({limit}): "
                                    f"{'this request needs ' + str(amount) + ' tokens; ' if kind == 'tokens' else ''}"
                                    f"retry after {math.ceil(v.reset_s)} s", retry_after=math.ceil(v.reset_s),
                               headers=headers)
        return headers

    async def enter(self, tenant: Tenant) -> str | None:
        """One more of its requests runs: the ticket that leave() takes (None: no max_concurrency), or the 429
        when max_concurrency of them run already."""
        limit = tenant.max_concurrency
        if limit is None:
            return None
        ticket = await self.slots.enter(tenant.name, limit)
        if ticket is None:
            tenant_refused(tenant.name, 429, "max_concurrency")
            raise APIError(429, f"tenant {tenant.name!r} has {limit} requests running, its max_concurrency: retry "
                                "when one ends", retry_after=1)
        return ticket

    async def leave(self, tenant: Tenant, ticket: str | None) -> None:
        if ticket is not None:
            await self.slots.leave(tenant.name, ticket)

    async def close(self) -> None:
        await self.windows.close()
        await self.slots.close()


def _headers(kind: str, v: Verdict) -> dict[str, str]:
    """OpenAI's rate-limit headers for requests or tokens (reset as OpenAI writes durations: 1s, 6m0s)."""
    return {f"x-ratelimit-limit-{kind}": str(v.limit), f"x-ratelimit-remaining-{kind}": str(v.remaining),
            f"x-ratelimit-reset-{kind}": _duration(v.reset_s)}


def _duration(seconds: float) -> str:
    seconds = max(math.ceil(seconds), 0)
    minutes, seconds = divmod(seconds, 60)
    return f"{minutes}m{seconds}s" if minutes else f"{seconds}s"
