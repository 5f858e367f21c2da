"""The tenants' per-minute counts (router.limits) in the Redis store the routers share (--responses-store
redis://...): this minute's count of a tenant's requests or tokens under stagemesh:ratelimit:<tenant>:<kind>:
<minute>, expiring after three minutes, so that every router naming the store counts against one limit. Each
call is bounded; while Redis does not answer, requests pass (a limiter that is down must not stop the service)
and the log says so once."""
from __future__ import annotations

import asyncio
import logging
import time

from redis.asyncio import Redis
from redis.exceptions import RedisError

from router.limits import WINDOW_S, RateWindows, Verdict, verdict
from router.responses_api.redis_store import TIMEOUT_S, redacted

KEY_PREFIX = "stagemesh:ratelimit:"
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
