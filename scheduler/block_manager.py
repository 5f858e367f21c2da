"""KV block manager: a fixed pool of blocks, reference counts, and hash-chained
full blocks so that a prompt prefix already in the cache is reused.

Pure Python; knows nothing of torch. Freed blocks keep their hash and stay
findable until the pool hands them out again (least recently freed first).
While someone listens (start_events), it records which blocks enter and leave
the prefix cache as KV events (scheduler.kv_events).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import cast

from scheduler.kv_events import BlockRemoved, BlockStored, KVEvent
from scheduler.tiers import KVTiers
from stagemesh.core.block_hash import chain_hash


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[int, int] = {}  # block hash -> block id
        self.tables: dict[str, list[int]] = {}  # request id -> its block ids
        self.hashes: dict[str, list[int]] = {}  # request id -> hashes of its full blocks
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.events: list[KVEvent] | None = None  # recorded only while someone listens
        self.tiers: KVTiers | None = None  # the host and disk tiers below the pool (scheduler.tiers)

    # -- KV events ------------------------------------------------------------------
    def start_events(self) -> None:
        if self.events is None:
            self.events = []

    def stop_events(self) -> None:
        self.events = None

    def drain_events(self) -> list[KVEvent]:
        events, self.events = self.events or [], ([] if self.events is not None else None)
        return events

    def cached_hashes(self) -> list[int]:
        return list(self.cached)

    def snapshot_hashes(self) -> list[tuple[str, list[int]]]:
        """(medium, hashes) of every tier: the pool's cached blocks, then the host and disk tiers'."""
        return [("device", list(self.cached)), *(self.tiers.snapshot() if self.tiers is not None else ())]

    # -- pins: a block being copied to a tier is not handed out meanwhile -----------------------------
    def pin(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free[block_id]
        block.ref_count += 1

    def unpin(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free[block_id] = None

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self.free) / len(self.blocks)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def find_cached_prefix(self, token_ids: list[int], root: int | None = None) -> list[int]:
        """Cached blocks holding a prefix of token_ids; at least one token is left to compute. `root`: the
        first block's parent (block_hash.adapter_root of the request's LoRA adapter)."""
        if not self.enable_prefix_caching:
            return []
        found, parent = [], root
        usable = (len(token_ids) - 1) // self.block_size
        for i in range(usable):
            parent = chain_hash(parent, token_ids[i * self.block_size:(i + 1) * self.block_size])
            block_id = self.cached.get(parent)
            if block_id is None:
                break
            found.append(block_id)
        return found

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_queries += num_tokens
        self.prefix_hits += num_hit_tokens

    def can_allocate(self, request_id: str, num_tokens: int, cached_blocks: list[int] | None = None) -> bool:
        """Whether allocate() would succeed."""
        cached_blocks = cached_blocks or []
        need = self.blocks_needed(num_tokens) - len(self.tables.get(request_id, ())) - len(cached_blocks)
        reuse_free = sum(1 for b in cached_blocks if self.blocks[b].ref_count == 0)
        return max(need, 0) + reuse_free <= len(self.free)

    def allocate(self, request_id: str, num_tokens: int, cached_blocks: list[int] | None = None) -> list[int] | None:
        """Grow the request's table to hold num_tokens; returns the block ids appended, or None if the
        pool is short (nothing changes then)."""
        table = self.tables.get(request_id, [])
        cached_blocks = cached_blocks or []
        need = self.blocks_needed(num_tokens) - len(table) - len(cached_blocks)
        if need <= 0 and not cached_blocks:
            return []  # the common decode step: the last block still has room
        if not self.can_allocate(request_id, num_tokens, cached_blocks):
            return None
        added = []
        for block_id in cached_blocks:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free[block_id]
            block.ref_count += 1
            added.append(block_id)
        for _ in range(max(need, 0)):
            block_id, _ = self.free.popitem(last=False)
            block = self.blocks[block_id]
            if block.block_hash is not None:  # a cached block leaves the cache for another use
                self.cached.pop(block.block_hash, None)
                if self.events is not None:
                    self.events.append(BlockRemoved([block.block_hash]))
                block.block_hash = None
            block.ref_count = 1
            added.append(block_id)
        self.tables[request_id] = table + added
        if cached_blocks:  # (blocks found in the prefix cache: each has its hash)
            self.hashes[request_id] = cast("list[int]", [self.blocks[b].block_hash for b in cached_blocks])
        return added

    def cache_full_blocks(self, request_id: str, token_ids: list[int], num_computed_tokens: int,
                          root: int | None = None) -> None:
        """Register the hashes of the request's blocks that are now full and computed (`root`: as in
        find_cached_prefix)."""
        if not self.enable_prefix_caching:
            return
        hashes = self.hashes.setdefault(request_id, [])
        table = self.tables.get(request_id, [])
        full = min(num_computed_tokens // self.block_size, len(table))
        bs, stored = self.block_size, []
        for i in range(len(hashes), full):
            parent = hashes[-1] if hashes else root
            block_hash = chain_hash(parent, token_ids[i * bs:(i + 1) * bs])
            hashes.append(block_hash)
            block = self.blocks[table[i]]
            if block.block_hash is None and block_hash not in self.cached:
                block.block_hash = block_hash
                self.cached[block_hash] = block.block_id
                stored.append(i)
                if self.tiers is not None:
                    self.tiers.offer(block.block_id, block_hash)
        if stored and self.events is not None:  # one event per run of consecutive blocks, as vLLM sends them
            for run in _runs(stored):
                self.events.append(BlockStored([hashes[i] for i in run], hashes[run[0] - 1] if run[0] else None,
                                               token_ids[run[0] * bs:(run[-1] + 1) * bs]))

    def free_request(self, request_id: str) -> None:
        # tail blocks first, so a shared prefix outlives the request's own suffix in the cache
        for block_id in reversed(self.tables.pop(request_id, [])):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free[block_id] = None
        self.hashes.pop(request_id, None)


def _runs(indices: list[int]) -> list[list[int]]:
    """Ascending indices split into runs of consecutive ones."""
    runs: list[list[int]] = []
    for i in indices:
        if runs and runs[-1][-1] == i - 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs
