"""KV tiers below the replica's KV pool (docs/kv-tiers.md): what the stages' host and disk tiers hold, as
the scheduler decides it. The stages only copy (stage_worker.kv_tiers); every decision is made here, so
the stages of a pipeline, and every TP rank of a stage, hold the same blocks in the same slots.

Write-through: a block that enters the prefix cache is copied into a host slot too (StoreKV, one call at a
time for everything pending: a store batches itself) and, with a disk tier, written on to disk. So a block
the pool evicts, or every block of a pool that started over (a new epoch, a restart on the same disk
directory), is loaded back (LoadKV) instead of computed. A block being stored is pinned in the pool until
its StoreKV returns; a host slot or a disk block being read is kept until its LoadKV returns. Both tiers
evict the least recently used block first; the disk tier's blocks outlive the process (the stages report
them when they join).

A request whose prompt continues, past its cached blocks, into blocks a tier holds gets blocks for them
and waits while they load (like a disaggregated-prefill pull, scheduler.kv_transfer); then it runs from
the first block that did not load. A block the stages could not load (a file missing, truncated, corrupt,
of another model) is computed, and leaves the tier.
"""
from __future__ import annotations

import logging
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from scheduler.kv_events import BlockRemoved, BlockStored, KVEvent
from scheduler.kv_sources import Found
from scheduler.status import Status
from stagemesh.core.block_hash import prefix_hashes

if TYPE_CHECKING:
    from scheduler.request import Request

log = logging.getLogger("stagemesh.scheduler")

FROM_DISK = -1  # a LoadJob's host slot for a block read from the disk tier
HOST, DISK = "host", "disk"


@dataclass
class StoreJob:
    """Pool blocks to copy into host slots (to_disk: and on to disk), and disk blocks to delete."""
    block_ids: list[int] = field(default_factory=list)
    host_slots: list[int] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)
    to_disk: list[bool] = field(default_factory=list)
    disk_evictions: list[int] = field(default_factory=list)


@dataclass
class LoadJob:
    """A request's blocks to fill from the tiers, in prompt order (host slot FROM_DISK: from disk)."""
    request_id: str
    block_ids: list[int]
    host_slots: list[int]
    hashes: list[int]


@dataclass
class TierStats:
    stored_blocks: Counter = field(default_factory=Counter)  # tier -> blocks written to it
    loaded_blocks: Counter = field(default_factory=Counter)  # tier -> blocks loaded back from it
    failed_loads: Counter = field(default_factory=Counter)  # tier -> blocks that did not load
    skipped_stores: int = 0  # blocks not stored: every host slot was being read


class BlockPool(Protocol):
    """What the tiers need of the pool above them (scheduler.block_manager.BlockManager, which offers them its
    blocks): its block size, pins on the blocks being copied down, and the event log their moves go to (None:
    nobody listens)."""
    block_size: int
    events: list[KVEvent] | None

    def pin(self, block_id: int) -> None: ...

    def unpin(self, block_id: int) -> None: ...


class KVTiers:
    def __init__(self, kv: BlockPool, num_host_blocks: int, num_disk_blocks: int, disk_hashes=()):
        self.kv = kv
        self.num_host_blocks, self.num_disk_blocks = num_host_blocks, num_disk_blocks
        self.host: OrderedDict[int, int] = OrderedDict()  # block hash -> host slot, stored; oldest use first
        self.free_slots = list(range(num_host_blocks - 1, -1, -1))
        self.storing: dict[int, int] = {}  # block hash -> host slot, its StoreKV pending or in flight
        self.disk: OrderedDict[int, None] = OrderedDict()  # block hashes on disk; oldest use first
        for h in list(disk_hashes)[-num_disk_blocks:] if num_disk_blocks else ():
            self.disk[h] = None
        self.reading: Counter = Counter()  # block hash -> loads in flight that read it (not evicted meanwhile)
        self.loading: dict[str, Request | None] = {}  # request id -> request (None: it ended during the load)
        self.stats = TierStats()
        self._stores = StoreJob()
        self._store_in_flight = False
        self._loads: list[LoadJob] = []

    # -- what the tiers hold ----------------------------------------------------------------
    def snapshot(self) -> list[tuple[str, list[int]]]:
        return [(HOST, list(self.host)), (DISK, list(self.disk))]

    def lookup(self, token_ids: list[int], num_cached_blocks: int, block_size: int,
               root: int | None = None) -> list[tuple[int, int]]:
        """The blocks after the prompt's first num_cached_blocks (those in the pool) that a tier holds, as far
        as they go on: (hash, host slot or FROM_DISK) each; at least one token is left to compute."""
        usable = (len(token_ids) - 1) // block_size
        if usable <= num_cached_blocks or not (self.host or self.disk):
            return []
        hits = []
        for h in prefix_hashes(token_ids[:usable * block_size], block_size, root)[num_cached_blocks:]:
            slot = self.host.get(h)
            if slot is None and h not in self.disk:
                break
            hits.append((h, FROM_DISK if slot is None else slot))
        return hits

    # -- a KV source (scheduler.kv_sources): a waiting request's blocks past the pool's, looked up once an admission
    def find(self, request: Request, shared: list[int]) -> Found | None:
        if request.tiers_checked or request.sampling.computes_whole_prompt:
            return None
        bs = self.kv.block_size
        hits = self.lookup(request.all_token_ids, len(shared), bs, request.hash_root)
        if not hits:
            request.tiers_checked = True
            return None
        return Found((len(shared) + len(hits)) * bs, shared, hits)  # (no room for it: looked up again when there is)

    def bring(self, request: Request, block_ids: list[int], found: Found) -> None:
        request.tiers_checked = True
        self.start_load(request, block_ids, found.hits)

    # -- storing -----------------------------------------------------------------------------
    def offer(self, block_id: int, block_hash: int) -> None:
        """A block entered the prefix cache: copy it down (write-through), unless a tier has it already."""
        if block_hash in self.host:
            self.host.move_to_end(block_hash)
            if block_hash in self.disk:
                self.disk.move_to_end(block_hash)
            return
        if block_hash in self.storing or not self.num_host_blocks:
            return
        slot = self._free_slot()
        if slot is None:
            self.stats.skipped_stores += 1
            return
        self.kv.pin(block_id)
        self.storing[block_hash] = slot
        job = self._stores
        job.block_ids.append(block_id)
        job.host_slots.append(slot)
        job.hashes.append(block_hash)
        job.to_disk.append(self.num_disk_blocks > 0 and block_hash not in self.disk)

    def _free_slot(self) -> int | None:
        if self.free_slots:
            return self.free_slots.pop()
        for h, slot in self.host.items():  # the least recently used one that no load is reading
            if not self.reading[h]:
                del self.host[h]
                self._event(BlockRemoved([h], medium=HOST))
                return slot
        return None

    def take_store(self) -> StoreJob | None:
        """What to store now, if anything and no store is in flight (one at a time: the next one takes
        everything that came meanwhile)."""
        job = self._stores
        if self._store_in_flight or not (job.block_ids or job.disk_evictions):
            return None
        self._stores, self._store_in_flight = StoreJob(), True
        return job

    def stored(self, job: StoreJob, ok: bool) -> None:
        """A StoreKV ended: its blocks are in their host slots (and on their way to disk), or, if it failed,
        in neither."""
        self._store_in_flight = False
        host, disk = [], []
        for block_id, slot, h, to_disk in zip(job.block_ids, job.host_slots, job.hashes, job.to_disk):
            self.kv.unpin(block_id)
            del self.storing[h]
            if not ok:
                self.free_slots.append(slot)
                continue
            self.host[h] = slot
            host.append(h)
            if to_disk and h not in self.disk:
                self.disk[h] = None
                disk.append(h)
        if ok:
            self.stats.stored_blocks[HOST] += len(host)
            self.stats.stored_blocks[DISK] += len(disk)
        for medium, hashes in ((HOST, host), (DISK, disk)):
            if hashes:
                self._event(BlockStored(hashes, None, medium=medium))
        self._trim_disk()

    def _trim_disk(self) -> None:
        evicted = []
        over = len(self.disk) - self.num_disk_blocks
        for h in list(self.disk) if over > 0 else ():
            if over <= 0:
                break
            if not self.reading[h]:
                del self.disk[h]
                evicted.append(h)
                over -= 1
        if evicted:
            self._stores.disk_evictions.extend(evicted)
            self._event(BlockRemoved(evicted, medium=DISK))

    # -- loading -----------------------------------------------------------------------------
    def start_load(self, request: Request, block_ids: list[int], hits: list[tuple[int, int]]) -> None:
        for h, slot in hits:
            self.reading[h] += 1
            (self.host if slot != FROM_DISK else self.disk).move_to_end(h)
        self.loading[request.request_id] = request
        request.status = Status.WAITING_FOR_REMOTE_KV
        self._loads.append(LoadJob(request.request_id, block_ids, [s for _, s in hits], [h for h, _ in hits]))

    def take_loads(self) -> list[LoadJob]:
        loads, self._loads = self._loads, []
        return loads

    def loaded(self, job: LoadJob, flags: list[bool]) -> int:
        """A LoadKV ended (flags: per block, whether every stage loaded it); returns how many leading blocks
        hold their KV now. A block that did not load leaves its tier (it is computed)."""
        good = 0
        while good < len(flags) and flags[good]:
            good += 1
        failed: dict[str, list[int]] = {HOST: [], DISK: []}
        for i, (h, slot) in enumerate(zip(job.hashes, job.host_slots)):
            self.reading[h] -= 1
            if not self.reading[h]:
                del self.reading[h]
            tier = DISK if slot == FROM_DISK else HOST
            if i < len(flags) and flags[i]:
                if i < good:
                    self.stats.loaded_blocks[tier] += 1
                continue
            self.stats.failed_loads[tier] += 1
            if tier == DISK and h in self.disk:
                del self.disk[h]
                failed[DISK].append(h)
            elif tier == HOST and self.host.get(h) == slot:
                del self.host[h]
                self.free_slots.append(slot)
                failed[HOST].append(h)
        for medium, hashes in failed.items():
            if hashes:
                log.warning("%d block(s) of request %s did not load from the %s tier: computing them",
                            len(hashes), job.request_id, medium)
                self._event(BlockRemoved(hashes, medium=medium))
        return good

    def abandon(self, request_id: str) -> bool:
        """The request ended during its load: True, and its blocks stay allocated until the load ends (the
        stages may be writing into them)."""
        if self.loading.get(request_id) is None:
            return False
        self.loading[request_id] = None
        return True

    def pending(self) -> list[Request]:
        return [r for r in self.loading.values() if r is not None]

    def _event(self, event) -> None:
        if self.kv.events is not None:
            self.kv.events.append(event)


def tier_blocks(size_bytes: int, kv_bytes_per_block: int) -> int:
    """Blocks a tier of size_bytes holds, every stage's layers and TP ranks together."""
    return int(size_bytes // kv_bytes_per_block) if size_bytes > 0 and kv_bytes_per_block > 0 else 0
