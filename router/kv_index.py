"""A global index of which replica holds which KV blocks in which tier, fed by the replicas' KV events, and
the `kv-aware` policy that routes by it.

Blocks are named by their chained hashes (stagemesh.core.block_hash), so the index is flat: a prompt's
leading blocks are held by a replica exactly as far as their hashes are in that replica's map (a hash names
a block and every block before it: the radix tree is in the hashes). Each hash maps to the tiers holding it
(a bitmask: device, host, disk). Each replica's map follows its scheduler's events (scheduler.proto
KVEventBatch): BlockStored(medium) adds a tier, BlockRemoved(medium) takes one away, AllBlocksCleared (the
first event of every snapshot) empties the map.

The index knows when it cannot be sure (KVFeed): the events are numbered (an epoch per cache, a seq per
batch), and a gap, a new epoch that is not a snapshot, a stream that broke, or more entries than the
replica can hold make that replica *degraded* until a new snapshot is in (its router re-subscribes). A
degraded replica's hits count for nothing: routing falls back to load there, never to a stale belief.
"""
from __future__ import annotations

from stagemesh.core.block_hash import prefix_hashes

DEVICE, HOST, DISK = 1, 2, 4  # a hash's tiers, as bits
# the tier named by an event's medium ("" is the device pool, as scheduler.proto says; a tier this router does
# not know is weighed as the slowest)
MEDIUM_BITS = {"": DEVICE, "device": DEVICE, "host": HOST, "disk": DISK}
MEDIUM_NAMES = {DEVICE: "device", HOST: "host", DISK: "disk"}
# What one block of a hit is worth, by the best tier holding it, against a miss (0: the block is computed
# again, a prefill). A device block costs nothing; a host block a memcpy back into the pool (on a GPU a PCIe
# copy, on a CPU a memory copy: far cheaper than its prefill, but not free); a disk block a file read and the
# copy (a page-cache hit is as cheap as host, a cold read is not). The weights only rank replicas with equal
# load: a longer hit in a lower tier still beats a shorter one on the device, and load beats both (KVAware).
TIER_WEIGHTS = {DEVICE: 1.0, HOST: 0.8, DISK: 0.5}
WEIGHT_OF_MASK = [max((w for bit, w in TIER_WEIGHTS.items() if mask & bit), default=0.0) for mask in range(8)]
# entries per replica when its capacity is not known (ModelInfo, Stats); else twice what it reports over every
# tier, plus some slack: past that, its events cannot be right (a flood, a bug) and the replica is resynced
HARD_CAP = 4_000_000
CAP_SLACK = 4096


class KVIndex:
    def __init__(self, hard_cap: int = HARD_CAP):
        self.blocks: dict[str, dict[int, int]] = {}  # replica address -> hash of a block it holds -> its tiers
        self.block_sizes: dict[str, int] = {}
        self.capacity: dict[str, int] = {}  # replica -> blocks it reports it can hold, over every tier
        self.degraded: dict[str, str] = {}  # replica -> why the index is unsure of it (absent: in sync)
        self.positions: dict[str, tuple[int, int]] = {}  # replica -> (epoch, seq) of the last batch applied
        self.hard_cap = hard_cap

    def cap(self, address: str) -> int:
        """The most entries the replica's map may hold."""
        capacity = self.capacity.get(address, 0)
        return 2 * capacity + CAP_SLACK if capacity > 0 else self.hard_cap

    def set_capacity(self, address: str, num_blocks: int) -> None:
        self.capacity[address] = num_blocks

    def stored(self, address: str, block_hashes, block_size: int, medium: str = "device") -> bool:
        """The blocks are now in that tier; False (and no more entries than the cap) when the replica's map
        would hold more than its cap: its events cannot be trusted (the caller clears it and resyncs)."""
        if block_size > 0:
            self.block_sizes[address] = block_size
        bit = MEDIUM_BITS.get(medium, DISK)
        entries = self.blocks.setdefault(address, {})
        cap = self.cap(address)
        for h in block_hashes:
            mask = entries.get(h)
            if mask is None:
                if len(entries) >= cap:
                    return False
                entries[h] = bit
            else:
                entries[h] = mask | bit
        return True

    def removed(self, address: str, block_hashes, medium: str = "device") -> None:
        """The blocks left that tier (unknown ones: nothing to do)."""
        entries = self.blocks.get(address)
        if not entries:
            return
        bit = MEDIUM_BITS.get(medium, DISK)
        for h in block_hashes:
            mask = entries.get(h)
            if mask is not None:
                if mask & ~bit:
                    entries[h] = mask & ~bit
                else:
                    del entries[h]

    def clear(self, address: str) -> None:
        self.blocks.pop(address, None)

    def forget(self, address: str) -> None:
        """A replica the router no longer balances over."""
        for table in (self.blocks, self.block_sizes, self.capacity, self.degraded, self.positions):
            table.pop(address, None)

    def num_blocks(self, address: str) -> int:
        return len(self.blocks.get(address, ()))

    def tiers(self, address: str) -> dict[str, list[int]]:
        """medium -> the hashes the index believes the replica holds there."""
        out: dict[str, list[int]] = {}
        for h, mask in self.blocks.get(address, {}).items():
            for bit, name in MEDIUM_NAMES.items():
                if mask & bit:
                    out.setdefault(name, []).append(h)
        return out

    # -- sure or not --------------------------------------------------------------------------------
    def mark_degraded(self, address: str, reason: str) -> str | None:
        """The index is unsure of the replica; returns why it was before (None: it was sure, a transition)."""
        was = self.degraded.get(address)
        self.degraded[address] = reason
        return was

    def mark_synced(self, address: str) -> bool:
        """A whole snapshot is in; True when it was degraded before (a transition)."""
        return self.degraded.pop(address, None) is not None

    def is_degraded(self, address: str) -> bool:
        return address in self.degraded

    # -- scoring --------------------------------------------------------------------------------------
    def match(self, address: str, prompt: list[int], hashes_by_size: dict[int, list[int]],
              root: int | None = None) -> tuple[int, float]:
        """(tokens, weighted tokens): how many leading tokens of the prompt the replica holds (whole blocks,
        in any tier: a prefix goes on across tiers), and the same with each block weighed by the best tier
        holding it (TIER_WEIGHTS); (0, 0) while the replica is degraded. hashes_by_size caches the prompt's
        hashes per block size across the replicas of one decision. root: the prompt's first block's parent
        (EngineRequest.hash_root: the schedulers hash the request's blocks from it)."""
        cached = self.blocks.get(address)
        size = self.block_sizes.get(address)
        if not cached or not size or address in self.degraded:
            return 0, 0.0
        if size not in hashes_by_size:
            hashes_by_size[size] = prefix_hashes(prompt, size, root)
        n, score = 0, 0.0
        for h in hashes_by_size[size]:
            mask = cached.get(h)
            if not mask:
                break
            n += 1
            score += WEIGHT_OF_MASK[mask]
        return n * size, score * size

    def matched_tokens(self, address: str, prompt: list[int], hashes_by_size: dict[int, list[int]]) -> int:
        return self.match(address, prompt, hashes_by_size)[0]


class KVFeed:
    """One subscription's batches (scheduler_pb2.KVEventBatch messages) applied to one replica's part of the
    index, checked: a stream begins with a snapshot; then every batch is the next seq of the same epoch (a
    batch sent as several messages: parts with `more`, the same epoch and seq). apply() returns why the
    replica must be resynced ("gap", "epoch", "overflow", "malformed"), or None; `synced` turns true once a
    whole snapshot is in. A scheduler from before epochs (epoch 0) is followed unchecked, as before."""

    def __init__(self, index: KVIndex, address: str):
        self.index, self.address = index, address
        self.epoch, self.seq = 0, 0
        self.synced = False
        self._part: tuple[int, int, bool] | None = None  # (epoch, seq, snapshot) of a batch whose parts go on

    def apply(self, batch) -> str | None:
        if batch.epoch == 0:  # unchecked: its first batch is AllBlocksCleared and a snapshot all the same
            self.synced = True
            return self._events(batch)
        if self._part is not None:
            if (batch.epoch, batch.seq, batch.snapshot) != self._part:
                return "gap"
        elif batch.snapshot:
            if not batch.events or batch.events[0].WhichOneof("event") != "all_blocks_cleared":
                return "malformed"
            self.epoch, self.seq, self.synced = batch.epoch, batch.seq, False
        elif not self.synced:
            return "gap"  # (a stream that does not begin with a snapshot)
        elif batch.epoch != self.epoch:
            return "epoch"  # a new cache whose snapshot this router did not get
        elif batch.seq != self.seq + 1:
            return "gap"
        else:
            self.seq = batch.seq
        self._part = (batch.epoch, batch.seq, batch.snapshot) if batch.more else None
        reason = self._events(batch)
        if reason is None and batch.snapshot and not batch.more:
            self.synced = True
        self.index.positions[self.address] = (self.epoch, self.seq)
        return reason

    def _events(self, batch) -> str | None:
        index, address = self.index, self.address
        for event in batch.events:
            kind = event.WhichOneof("event")
            if kind == "block_stored":
                e = event.block_stored
                if len(e.token_ids) > len(e.block_hashes) * max(e.block_size, 1):
                    return "malformed"  # (the router keeps no tokens, but a sender of these is not to be trusted)
                if not index.stored(address, e.block_hashes, e.block_size, e.medium):
                    index.clear(address)
                    return "overflow"
            elif kind == "block_removed":
                index.removed(address, event.block_removed.block_hashes, event.block_removed.medium)
            else:
                index.clear(address)
        return None


class KVAware:
    """The replica whose caches hold the most of the prompt's leading tokens (as its KV events tell), each
    block weighed by the best tier holding it (TIER_WEIGHTS), among the replicas that are not much busier
    than the least loaded one; the least loaded when none holds any. A degraded replica holds none."""

    def __init__(self, index: KVIndex | None = None, balance_abs: int = 32, balance_rel: float = 1.5):
        self.index = index or KVIndex()
        self.balance_abs, self.balance_rel = balance_abs, balance_rel
        self.last_matched_tokens = 0  # of the latest decision, in any tier (metrics)

    def pick(self, replicas, prompt, root: int | None = None):
        least = min(replicas, key=lambda r: r.load)
        hashes: dict[int, list[int]] = {}
        best, best_matched, best_score = least, 0, 0.0
        for r in replicas:
            if r.load - least.load > self.balance_abs and r.load > self.balance_rel * max(least.load, 1):
                continue  # a cache hit does not pay for a long queue
            matched, score = self.index.match(r.address, prompt, hashes, root)
            if score > best_score or (score == best_score and score and r.load < best.load):
                best, best_matched, best_score = r, matched, score
        self.last_matched_tokens = best_matched
        return best
