"""KV cache events (vLLM's kv_events shapes): which blocks of a replica's prefix cache are stored and
which were evicted, for routers that send a prompt where its prefix is cached.

The block manager records them while someone listens (BlockManager.start_events); KVEventHub follows the
replica's current block manager (a new one at every epoch, or when a broken pipeline's requests are
requeued), drains it every tick and fans the batches out to its subscribers. A subscriber's stream begins
with AllBlocksCleared and a BlockStored of every block cached then, and so does the stream of every
subscriber whenever the replica's cache starts over: a router never has to guess what it missed.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Callable


@dataclass(frozen=True)
class BlockStored:
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int] = field(default_factory=list)  # the blocks' tokens (empty in a snapshot)
    medium: str = "device"  # the tier now holding them: "device" (the KV pool), "host" or "disk"


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: list[int]
    medium: str = "device"  # the tier they left (another may still hold them)


@dataclass(frozen=True)
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True)
class KVEventBatch:
    ts: float
    events: list[KVEvent]


TICK_S = 0.05
QUEUE_LIMIT = 1024  # batches a subscriber may fall behind before its stream is ended (it subscribes again)


class KVEventHub:
    def __init__(self, block_manager: Callable[[], object | None], tick_s: float = TICK_S):
        self._current = block_manager  # the replica's block manager now, or None (no pipeline)
        self._followed: object | None = None
        self._subscribers: set[asyncio.Queue] = set()
        self._tick_s = tick_s
        self._task: asyncio.Task | None = None

    def subscribe(self) -> asyncio.Queue:
        """A queue of KVEventBatch, the first one a snapshot; None in it: the stream is over (too slow)."""
        self._publish(self._drain())  # the others' events so far, before this one's snapshot
        queue: asyncio.Queue = asyncio.Queue(QUEUE_LIMIT + 1)
        queue.put_nowait(KVEventBatch(time.time(), self._snapshot(self._followed)))
        self._subscribers.add(queue)
        if self._task is None:
            self._task = asyncio.create_task(self._run())
        return queue

    def unsubscribe(self, queue: asyncio.Queue) -> None:
        self._subscribers.discard(queue)

    async def _run(self) -> None:
        while self._subscribers:
            await asyncio.sleep(self._tick_s)
            self._publish(self._drain())
        self._task = None
        if self._followed is not None:
            self._followed.stop_events()
            self._followed = None

    def _drain(self) -> list[KVEvent]:
        """Events of the followed block manager since the last drain; a snapshot when it changed."""
        current = self._current()
        if current is not self._followed:
            if self._followed is not None:
                self._followed.stop_events()
            self._followed = current
            return self._snapshot(current)
        return current.drain_events() if current is not None else []

    def _snapshot(self, manager) -> list[KVEvent]:
        if manager is None:
            return [AllBlocksCleared()]
        manager.start_events()
        cached = manager.cached_hashes()
        return [AllBlocksCleared(), *([BlockStored(cached, None)] if cached else [])]

    def _publish(self, events: list[KVEvent]) -> None:
        if not events:
            return
        batch = KVEventBatch(time.time(), events)
        for queue in list(self._subscribers):
            if queue.qsize() >= QUEUE_LIMIT:
                self._subscribers.discard(queue)
                queue.put_nowait(None)
            else:
                queue.put_nowait(batch)
