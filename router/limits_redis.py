"""The tenants' counts (router.limits) in the Redis store the routers share (--responses-store redis://...), so
that every router naming the store counts against one limit:
- per minute: this minute's count of a tenant's requests or tokens under stagemesh:ratelimit:<tenant>:<kind>:
  <minute>, expiring after three minutes;
- in flight (max_concurrency): a sorted set per tenant, stagemesh:concurrency:<tenant>, of the requests that run,
  each scored by when its lease lapses (on Redis's clock, so the routers' clocks need not agree). A router renews
  its requests' leases every LEASE_S / 3 while they run; one that dies frees its places within LEASE_S.
Each call is bounded; while Redis does not answer, requests pass (a limiter that is down must not stop the
service) and the log says so once."""
from __future__ import annotations

import asyncio
import logging
import time
import uuid

from redis.asyncio import Redis
from redis.exceptions import RedisError

from router.limits import WINDOW_S, RateWindows, Slots, Verdict, verdict
from router.responses_api.redis_store import TIMEOUT_S, redacted

KEY_PREFIX = "stagemesh:ratelimit:"
SLOTS_PREFIX = "stagemesh:concurrency:"
LEASE_S = 30.0  # a request's place: renewed every LEASE_S / 3 while it runs, lapsed LEASE_S after its router died
# drop the lapsed places, then take one if fewer than the limit are held (KEYS[1]; ARGV: limit, ticket, lease)
ENTER = """
local now = redis.call('TIME')
local t = tonumber(now[1]) + tonumber(now[2]) / 1000000
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', t)
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[1]) then return 0 end
redis.call('ZADD', KEYS[1], t + tonumber(ARGV[3]), ARGV[2])
redis.call('EXPIRE', KEYS[1], math.ceil(2 * tonumber(ARGV[3])))
return 1
"""
# the leases of this router's places in KEYS[1] renewed (ARGV: lease, tickets...)
RENEW = """
local now = redis.call('TIME')
local t = tonumber(now[1]) + tonumber(now[2]) / 1000000
for i = 2, #ARGV do redis.call('ZADD', KEYS[1], t + tonumber(ARGV[1]), ARGV[i]) end
redis.call('EXPIRE', KEYS[1], math.ceil(2 * tonumber(ARGV[1])))
return 0
"""
log = logging.getLogger("stagemesh.router")


class RedisWindows(RateWindows):
    def __init__(self, url: str, clock=time.time):
        self.name, self.clock = redacted(url), clock
        self._client = Redis.from_url(url, socket_timeout=TIMEOUT_S, socket_connect_timeout=TIMEOUT_S)
        self._down = False

    def describe(self) -> str:
        return f"{self.name} (shared by the routers that name it)"

    async def take(self, key: str, amount: int, limit: int) -> Verdict:
        now = self.clock()
        minute = int(now // WINDOW_S)
        current_key, previous_key = f"{KEY_PREFIX}{key}:{minute}", f"{KEY_PREFIX}{key}:{minute - 1}"
        try:
            async with self._client.pipeline(transaction=True) as pipe:
                pipe.incrby(current_key, amount)
                pipe.expire(current_key, int(3 * WINDOW_S))
                pipe.get(previous_key)
                current, _, previous = await asyncio.wait_for(pipe.execute(), 4 * TIMEOUT_S)
            v = verdict(int(previous or 0), int(current), amount, limit, now)
            if not v.ok:
                await asyncio.wait_for(self._client.decrby(current_key, amount), 2 * TIMEOUT_S)
        except (RedisError, OSError, asyncio.TimeoutError) as err:
            if not self._down:
                log.warning("rate limits: the store %s does not answer (%s): requests pass uncounted until it "
                            "does", self.name, err or type(err).__name__)
            self._down = True
            return Verdict(True, limit, limit, 0.0)
        if self._down:
            log.info("rate limits: the store %s answers again", self.name)
            self._down = False
        return v

    async def close(self) -> None:
        await self._client.aclose()


class RedisSlots(Slots):
    """max_concurrency over every router that names the store: places held as leases (the module's docstring)."""

    def __init__(self, url: str, lease_s: float = LEASE_S):
        self.name, self.lease_s = redacted(url), lease_s
        self._client = Redis.from_url(url, socket_timeout=TIMEOUT_S, socket_connect_timeout=TIMEOUT_S)
        self._enter, self._renew = self._client.register_script(ENTER), self._client.register_script(RENEW)
        self._prefix = uuid.uuid4().hex[:12]  # this router's tickets
        self._count = 0
        self.held: dict[str, set[str]] = {}  # key -> this router's tickets there
        self._renewer: asyncio.Task | None = None
        self._down = False

    async def enter(self, key: str, limit: int) -> str | None:
        self._count += 1
        ticket = f"{self._prefix}:{self._count}"
        try:
            ok = await asyncio.wait_for(self._enter(keys=[SLOTS_PREFIX + key], args=[limit, ticket, self.lease_s]),
                                        4 * TIMEOUT_S)
        except (RedisError, OSError, asyncio.TimeoutError) as err:
            self._report_down(err)
            return ticket  # (uncounted: its leave finds nothing to remove)
        self._report_up()
        if not ok:
            return None
        self.held.setdefault(key, set()).add(ticket)
        if self._renewer is None or self._renewer.done():
            self._renewer = asyncio.create_task(self._renew_loop())
        return ticket

    async def leave(self, key: str, ticket: str) -> None:
        tickets = self.held.get(key)
        if tickets is not None:
            tickets.discard(ticket)
            if not tickets:
                del self.held[key]
        try:
            await asyncio.wait_for(self._client.zrem(SLOTS_PREFIX + key, ticket), 2 * TIMEOUT_S)
        except (RedisError, OSError, asyncio.TimeoutError) as err:  # (its lease lapses)
            self._report_down(err)

    async def _renew_loop(self) -> None:
        """Renew the held places' leases every lease / 3 until none is held."""
        while self.held:
            await asyncio.sleep(self.lease_s / 3)
            for key, tickets in list(self.held.items()):
                try:
                    await asyncio.wait_for(self._renew(keys=[SLOTS_PREFIX + key], args=[self.lease_s, *tickets]),
                                           4 * TIMEOUT_S)
                except (RedisError, OSError, asyncio.TimeoutError) as err:
                    self._report_down(err)

    def _report_down(self, err: BaseException) -> None:
        if not self._down:
            log.warning("max_concurrency: the store %s does not answer (%s): requests pass uncounted until it "
                        "does", self.name, err or type(err).__name__)
        self._down = True

    def _report_up(self) -> None:
        if self._down:
            log.info("max_concurrency: the store %s answers again", self.name)
            self._down = False

    async def close(self) -> None:
        if self._renewer is not None:
            self._renewer.cancel()
        for key, tickets in list(self.held.items()):
            try:
                await asyncio.wait_for(self._client.zrem(SLOTS_PREFIX + key, *tickets), 2 * TIMEOUT_S)
            except (RedisError, OSError, asyncio.TimeoutError):
                pass  # (their leases lapse)
        self.held.clear()
        await self._client.aclose()
