"""The KV tiers over a stage's TP ranks: what rank 0 tells its followers of a StoreKV or a LoadKV.

Each rank stores and loads its own shard (stage_worker.kv_tiers). A store is one KV_TIER_STORE message, run in
step order. A load is two: KV_TIER_READ, on which every rank starts reading its files on a thread of its own
(off the step loop), and KV_TIER_FILL, in step order, on which every rank takes its reads, the group agrees per
block (agree: MIN over the ranks) and each fills the blocks all of them can. Payloads are little-endian int64 /
uint64 columns, never pickled.
"""
from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from stage_worker import control
from stage_worker.kv_tiers import KVTierStore, agree

log = logging.getLogger("stagemesh.follower")
MAX_PENDING_READS = 64  # reads whose fill never came (rank 0's load failed): the oldest are dropped


def _columns(head: list[int], *columns: tuple[list[int], str]) -> bytes:
    return np.array(head, dtype="<i8").tobytes() + b"".join(np.array(c, dtype=t).tobytes() for c, t in columns)


def _split(payload: bytes, num_head: int, kinds: list[str], lengths: list[int]) -> tuple[list[int], list[list]]:
    head = np.frombuffer(payload, dtype="<i8", count=num_head).tolist()
    out, offset = [], 8 * num_head
    for kind, n in zip(kinds, lengths):
        out.append(np.frombuffer(payload, dtype=kind, count=n, offset=offset).tolist())
        offset += 8 * n
    return head, out


def encode_store(block_ids, host_slots, hashes, to_disk, evictions) -> bytes:
    return _columns([len(block_ids), len(evictions)], (block_ids, "<i8"), (host_slots, "<i8"), (hashes, "<u8"),
                    ([int(d) for d in to_disk], "<i8"), (evictions, "<u8"))


def decode_store(payload: bytes) -> tuple[list[int], list[int], list[int], list[bool], list[int]]:
    n, e = np.frombuffer(payload, dtype="<i8", count=2).tolist()
    _, (ids, slots, hashes, to_disk, evictions) = _split(payload, 2, ["<i8", "<i8", "<u8", "<i8", "<u8"],
                                                         [n, n, n, n, e])
    return ids, slots, hashes, [bool(d) for d in to_disk], evictions


def encode_load(load_id: int, block_ids: list[int], host_slots: list[int], hashes: list[int]) -> bytes:
    return _columns([load_id, len(host_slots)], (block_ids, "<i8"), (host_slots, "<i8"), (hashes, "<u8"))


def decode_load(payload: bytes) -> tuple[int, list[int], list[int], list[int]]:
    load_id, n = np.frombuffer(payload, dtype="<i8", count=2).tolist()
    _, (ids, slots, hashes) = _split(payload, 2, ["<i8", "<i8", "<u8"], [n, n, n])
    return load_id, ids, slots, hashes


def finish_load(tiers: KVTierStore, runner, block_ids: list[int], host_slots: list[int], hashes: list[int],
                reads: list) -> list[bool]:
    """Every rank, between steps: the blocks every rank can fill are filled; returns them."""
    ok = agree(runner.tp, tiers.ready(host_slots, hashes, reads), runner.device)
    tiers.fill(block_ids, host_slots, reads, ok)
    return ok


class TierFollower:
    """A follower's side of the tiers: its store, and the reads it started for fills to come."""

    def __init__(self, tiers: KVTierStore):
        self.tiers = tiers
        self.reads: dict[int, Future] = {}
        self._readers = ThreadPoolExecutor(1, thread_name_prefix="kv-tier-read")

    def reset(self) -> None:
        """A new epoch: reads of the old one are forgotten."""
        self.reads.clear()

    def handle(self, runner, kind: int, payload: bytes) -> None:
        if kind == control.KV_TIER_STORE:
            self.tiers.store(*decode_store(payload))
        elif kind == control.KV_TIER_READ:
            load_id, _, slots, hashes = decode_load(payload)
            self.reads[load_id] = self._readers.submit(self.tiers.read, slots, hashes)
            while len(self.reads) > MAX_PENDING_READS:
                self.reads.pop(next(iter(self.reads)))
        else:  # KV_TIER_FILL
            load_id, ids, slots, hashes = decode_load(payload)
            future = self.reads.pop(load_id, None)
            try:
                reads = future.result() if future is not None else [None] * len(ids)
            except Exception as err:  # noqa: BLE001 - a failed read is a miss; the group still agrees
                log.warning("KV tier read failed: %s", err)
                reads = [None] * len(ids)
            finish_load(self.tiers, runner, ids, slots, hashes, reads)
