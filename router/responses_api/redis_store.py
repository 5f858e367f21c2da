"""The response store on a Redis server (--responses-store redis://..., rediss://... or unix://...), which every
router naming it shares: each response a JSON value under stagemesh:responses:<id>, expiring after
--responses-store-ttl seconds. Calls go through redis-py's asyncio client and are bounded (socket timeouts, one
fresh connection after a broken one, a deadline over the whole call): a store that is down or hung answers
503 naming it, and the next request tries again."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar
from urllib.parse import urlsplit, urlunsplit

from redis.asyncio import ConnectionPool, Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from router.errors import APIError
from router.responses_api.store import ResponseStore, Stored, StoreUnavailable

KEY_PREFIX = "stagemesh:responses:"
# a background response's events (a list), its runner's lease and its cancel flag, each beside its response
EVENTS_PREFIX, LEASE_PREFIX, CANCEL_PREFIX = "stagemesh:response-events:", "stagemesh:response-lease:", \
    "stagemesh:response-cancel:"
# take the lease when it is free or this owner's, and (re)set its expiry: one round trip, atomic
_CLAIM = """
local held = redis.call('GET', KEYS[1])
if held and held ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
"""
# socket_timeout and socket_connect_timeout unless the URL sets them (?socket_timeout=0.5): a store on the
# same network answers in milliseconds, and a hung one must not hold a request longer than this
TIMEOUT_S = 1.0
T = TypeVar("T")
log = logging.getLogger("stagemesh.router")


def check_url(url: str) -> None:
    """ValueError when redis-py would refuse the URL (its scheme, port, query options)."""
    try:
        ConnectionPool.from_url(url).make_connection()  # builds, does not connect
    except (ValueError, TypeError) as err:
        raise ValueError(f"--responses-store {redacted(url)}: {err}") from None


def redacted(url: str) -> str:
    """The URL without its credentials or query (which may hold a password)."""
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc.rpartition("@")[2], parts.path, "", ""))


class RedisStore(ResponseStore):
    def __init__(self, url: str, ttl_s: float):
        self.name = redacted(url)
        self.ttl_s = ttl_s
        self._down = False  # the last call failed (logged once)
        # one retry, on a fresh connection, and only when the connection broke (a server restarted since it
        # was pooled); a timeout is not retried
        retry = Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,))
        self._client = Redis.from_url(url, socket_timeout=TIMEOUT_S, socket_connect_timeout=TIMEOUT_S, retry=retry)
        options = self._client.connection_pool.connection_kwargs
        self._deadline_s = (options.get("socket_connect_timeout") or TIMEOUT_S) * 2 + \
            (options.get("socket_timeout") or TIMEOUT_S) * 2

    async def put(self, response_id: str, entry: Stored) -> None:
        ttl_ms = max(1, round(self.ttl_s * 1000))
        await self._call(lambda: self._client.set(KEY_PREFIX + response_id, entry.to_json(), px=ttl_ms))

    async def get(self, response_id: str) -> Stored | None:
        key = KEY_PREFIX + response_id
        raw = await self._call(lambda: self._client.get(key))
        if raw is None:
            return None
        try:
            return Stored.from_json(raw)
        except ValueError as err:  # (json's errors are ValueErrors)
            raise APIError(500, f"the response store {self.name} holds an unreadable value under '{key}': "
                                f"{err}") from None

    async def delete(self, response_id: str) -> bool:
        keys = [prefix + response_id for prefix in (KEY_PREFIX, EVENTS_PREFIX, LEASE_PREFIX, CANCEL_PREFIX)]
        return bool(await self._call(lambda: self._client.delete(*keys)))

    async def append_events(self, response_id: str, events: list[str]) -> None:
        if not events:
            return
        key, ttl_ms = EVENTS_PREFIX + response_id, max(1, round(self.ttl_s * 1000))

        async def push():
            async with self._client.pipeline(transaction=True) as pipe:
                pipe.rpush(key, *events)
                pipe.pexpire(key, ttl_ms)
                await pipe.execute()
        await self._call(push)

    async def events(self, response_id: str, start: int) -> list[str]:
        raw = await self._call(lambda: self._client.lrange(EVENTS_PREFIX + response_id, start, -1))
        return [e.decode() if isinstance(e, bytes) else e for e in raw]

    async def claim(self, response_id: str, owner: str, ttl_s: float) -> bool:
        ms = max(1, round(ttl_s * 1000))
        return bool(await self._call(lambda: self._client.eval(_CLAIM, 1, LEASE_PREFIX + response_id, owner, ms)))

    async def request_cancel(self, response_id: str) -> None:
        ttl_ms = max(1, round(self.ttl_s * 1000))
        await self._call(lambda: self._client.set(CANCEL_PREFIX + response_id, b"1", px=ttl_ms))

    async def cancel_requested(self, response_id: str) -> bool:
        return bool(await self._call(lambda: self._client.exists(CANCEL_PREFIX + response_id)))

    def missing_hint(self) -> str:
        return f"or has expired (responses are kept {self.ttl_s:g} s, --responses-store-ttl)"

    def describe(self) -> str:
        return f"{self.name} (shared by the routers that name it; each response kept {self.ttl_s:g} s, " \
               "--responses-store-ttl)"

    async def unreachable(self) -> str | None:
        try:
            await self._call(self._client.ping, quiet=True)
        except StoreUnavailable as err:
            return err.reason
        return None

    async def close(self) -> None:
        await self._client.aclose()

    async def _call(self, command: Callable[[], Awaitable[T]], quiet: bool = False) -> T:
        """The command's answer, or StoreUnavailable (logged unless `quiet`: the caller logs it)."""
        try:
            result = await asyncio.wait_for(command(), self._deadline_s)
        except asyncio.TimeoutError:
            raise self._failed(f"no answer within {self._deadline_s:g} s", quiet) from None
        except (RedisError, OSError) as err:
            raise self._failed(str(err) or type(err).__name__, quiet) from None
        if self._down:
            self._down = False
            log.info("the response store %s answers again", self.name)
        return result

    def _failed(self, reason: str, quiet: bool) -> StoreUnavailable:
        """The error to answer; the log says when the store went down (once, not for every request)."""
        err = StoreUnavailable(self.name, reason)
        if not self._down and not quiet:
            log.warning("the response store %s is unavailable (%s): stored responses answer 503 until it is back",
                        self.name, err.reason)
        self._down = True
        return err
