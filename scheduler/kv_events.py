"""KV cache events (vLLM's kv_events shapes): which blocks of a replica's KV cache are stored and which were
evicted, in which tier (vLLM's medium: "device", the working pool; "host" and "disk", the lower tiers), for
routers that send a prompt where its prefix is cached.

The block manager records them while someone listens (BlockManager.start_events); KVEventHub follows the
replica's current block manager (a new one at every epoch, or when a broken pipeline's requests are
requeued), drains it every tick and fans the batches out to its subscribers. A subscriber's stream begins
with a snapshot (AllBlocksCleared and a BlockStored per tier of every block held then), and so does the
stream of every subscriber whenever the replica's cache starts over.

The batches are numbered (scheduler.proto KVEventBatch): an epoch, a random 64-bit id of the cache being
followed (new at start and whenever the followed block manager changes), and a seq, 1, 2, 3... per
epoch, one per batch broadcast; a snapshot carries the seq it is consistent with. A follower that sees a
gap, or a new epoch without a snapshot, knows it missed something and subscribes again.
"""
from __future__ import annotations

import asyncio
import logging
import os
import secrets
import time
import weakref
from dataclasses import dataclass, field
from typing import Callable, Protocol

log = logging.getLogger("stagemesh.scheduler")

DEVICE, HOST, DISK = "device", "host", "disk"
MEDIUMS = (DEVICE, HOST, DISK)


@dataclass(frozen=True)
class BlockStored:
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int] = field(default_factory=list)  # the blocks' tokens (empty in a snapshot)
    medium: str = DEVICE  # the tier the blocks are now in


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: list[int]
    medium: str = DEVICE  # the tier they left (they may still be in another one)


@dataclass(frozen=True)
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True)
class KVEventBatch:
    ts: float
    events: list[KVEvent]
    epoch: int = 0
    seq: int = 0
    snapshot: bool = False  # the events are the whole state as of seq


TICK_S = 0.05
QUEUE_LIMIT = 1024  # batches a subscriber may fall behind before its stream is ended (it subscribes again)
# A test hook, and nothing else: the hub counts broadcast batch N of every epoch but sends it to nobody, as
# if the network had lost it (tests/test_kv_index_recovery.py)
DROP_SEQ_ENV = "STAGEMESH_TEST_DROP_KV_EVENT_SEQ"


class EventSource(Protocol):
    """What the hub follows: a replica's block manager (scheduler.block_manager.BlockManager), which records
    these events; declared here, below it, so that the events need nothing of what records them."""

    def start_events(self) -> None: ...

    def stop_events(self) -> None: ...

    def drain_events(self) -> list[KVEvent]: ...

    def snapshot_hashes(self) -> list[tuple[str, list[int]]]: ...


def new_epoch() -> int:
    return secrets.randbits(64) or 1  # (never 0: 0 is a scheduler from before epochs)


class KVEventHub:
    def __init__(self, block_manager: Callable[[], EventSource | None], tick_s: float = TICK_S):
        self._current = block_manager  # the replica's block manager now, or None (no pipeline)
        self._followed: EventSource | None = None
        self._epoch_of: Callable[[], object | None] = lambda: None  # (a weak reference) the epoch's manager
        self.epoch, self.seq = new_epoch(), 0
        self._subscribers: set[asyncio.Queue] = set()
        self._tick_s = tick_s
        self._task: asyncio.Task | None = None
        self._drop_seq = int(os.environ.get(DROP_SEQ_ENV, "0") or 0)
        if self._drop_seq:
            log.warning("%s=%d: KV event batch %d of every epoch is dropped (a test hook)", DROP_SEQ_ENV,
                        self._drop_seq, self._drop_seq)

    def subscribe(self) -> asyncio.Queue:
        """A queue of KVEventBatch, the first one a snapshot; None in it: the stream is over (too slow)."""
        self._publish(*self._drain())  # the others' events so far, before this one's snapshot
        queue: asyncio.Queue = asyncio.Queue(QUEUE_LIMIT + 1)
        queue.put_nowait(KVEventBatch(time.time(), self._snapshot(self._followed), self.epoch, self.seq, True))
        self._subscribers.add(queue)
        if self._task is None:
            self._task = asyncio.create_task(self._run())
        return queue

    def unsubscribe(self, queue: asyncio.Queue) -> None:
        self._subscribers.discard(queue)

    def snapshot(self) -> tuple[int, int, list[tuple[str, list[int]]]]:
        """(epoch, seq, (medium, hashes) per tier): what the replica holds now, consistent with the stream's
        seq (0, 0 and the current cache when nobody follows the events)."""
        if not self._subscribers:
            manager = self._current()
            return 0, 0, manager.snapshot_hashes() if manager is not None else []
        self._publish(*self._drain())  # (what happened since the last tick gets its seq first)
        manager = self._followed
        return self.epoch, self.seq, manager.snapshot_hashes() if manager is not None else []

    async def _run(self) -> None:
        while self._subscribers:
            await asyncio.sleep(self._tick_s)
            self._publish(*self._drain())
        self._task = None
        if self._followed is not None:
            self._followed.stop_events()
            self._followed = None

    def _drain(self) -> tuple[list[KVEvent], bool]:
        """Events of the followed block manager since the last drain, and whether they are a snapshot: one
        when it changed (a new epoch, unless it is the manager of the epoch, followed again)."""
        current = self._current()
        if current is not self._followed:
            if self._followed is not None:
                self._followed.stop_events()
            self._followed = current
            if current is None or current is not self._epoch_of():
                self.epoch, self.seq = new_epoch(), 0
                self._epoch_of = weakref.ref(current) if current is not None else (lambda: None)
            return self._snapshot(current), True
        return (current.drain_events() if current is not None else []), False

    def _snapshot(self, manager) -> list[KVEvent]:
        if manager is None:
            return [AllBlocksCleared()]
        manager.start_events()
        return [AllBlocksCleared(), *(BlockStored(hashes, None, medium=medium)
                                      for medium, hashes in manager.snapshot_hashes() if hashes)]

    def _publish(self, events: list[KVEvent], snapshot: bool = False) -> None:
        if not events:
            return
        self.seq += 1
        if self.seq == self._drop_seq:
            return
        batch = KVEventBatch(time.time(), events, self.epoch, self.seq, snapshot)
        for queue in list(self._subscribers):
            if queue.qsize() >= QUEUE_LIMIT:
                self._subscribers.discard(queue)
                queue.put_nowait(None)
            else:
                queue.put_nowait(batch)
