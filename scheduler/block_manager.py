"""KV block manager: a fixed pool of blocks, reference counts, and hash-chained
full blocks so that a prompt prefix already in the cache is reused.

Pure Python; knows nothing of torch. Freed blocks keep their hash and stay
findable until the pool hands them out again (least recently freed first).
While someone listens (start_events), it records which blocks enter and leave
the prefix cache as KV events (scheduler.kv_events).

With a model's KV cache groups (stagemesh.core.kv_groups: sliding-window layers
beside full ones), a request has a table per group, all drawn from the pool; a
sliding group's blocks that fall out of its window go back to the pool
(free_outside_window) and leave NULL_BLOCK in its table. Block ids handed to the
stages are group-major: each group's new blocks in turn, as many for each. Each
group has its own prefix cache (the same chained hashes); a prefix hit is the
longest whose full groups hold every block and whose sliding groups hold the
window before it (vLLM's hybrid KV cache manager). KV events and the tiers see
the first group only.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from scheduler.kv_events import BlockRemoved, BlockStored, KVEvent
from scheduler.tiers import KVTiers
from stagemesh.core.block_hash import chain_hash
from stagemesh.core.kv_groups import FULL, NULL_BLOCK


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None
    group: int = 0  # the group whose prefix cache knows it by block_hash


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 windows: tuple[int, ...] = (FULL,), lookback: int = 0):
        """windows: each KV cache group's sliding window (FULL: full attention); lookback: the tokens a step's
        result may take back (speculative drafts rejected), kept in every window."""
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.windows = tuple(windows) or (FULL,)
        self.num_groups = len(self.windows)
        self.hybrid = any(self.windows)
        self.lookback = lookback
        self.blocks = [Block(i) for i in range(num_blocks)]
        reserved = 0
        if self.hybrid:  # NULL_BLOCK stands for a freed block in a sliding table: never handed out nor cached
            self.blocks[NULL_BLOCK].ref_count, self.blocks[NULL_BLOCK].block_hash, reserved = 1, -1, 1
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(reserved, num_blocks))
        self._usable = num_blocks - reserved
        self.cached: dict[int, int] = {}  # block hash -> block id (the first group's)
        self.group_cached: list[dict[int, int]] = [self.cached, *({} for _ in self.windows[1:])]
        self.tables: dict[str, list[int]] = {}  # request id -> its block ids (the first group's)
        self.group_tables: dict[str, list[list[int]]] = {}  # with groups: every group's table (tables' first)
        self.window_start: dict[str, list[int]] = {}  # with groups: per group, the table's first block not freed
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

    # -- references: a request's, or a pin while a block is copied to a tier (not handed out meanwhile) ----------
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
        return self._usable

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self.free) / self._usable

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def find_cached_prefix(self, token_ids: list[int], root: int | None = None) -> list[int]:
        """Cached blocks holding a prefix of token_ids; at least one token is left to compute. `root`: the
        first block's parent (block_hash.adapter_root of the request's LoRA adapter)."""
        if not self.enable_prefix_caching:
            return []
        if self.hybrid:
            return self._prefix_of_groups(token_ids, root)
        found, parent = [], root
        usable = (len(token_ids) - 1) // self.block_size
        for i in range(usable):
            parent = chain_hash(parent, token_ids[i * self.block_size:(i + 1) * self.block_size])
            block_id = self.cached.get(parent)
            if block_id is None:
                break
            found.append(block_id)
        return found

    def _prefix_of_groups(self, token_ids: list[int], root: int | None) -> list[int]:
        """find_cached_prefix with groups: the longest prefix of h blocks every full group holds whole and every
        sliding group holds from the first block its window reaches back to (a miss at block j: h falls to j);
        each group's blocks in turn, NULL_BLOCK before a sliding group's window."""
        bs, usable = self.block_size, (len(token_ids) - 1) // self.block_size
        full = [self.group_cached[g] for g, w in enumerate(self.windows) if w == FULL]
        hashes, parent = [], root
        for i in range(usable):
            parent = chain_hash(parent, token_ids[i * bs:(i + 1) * bs])
            if any(parent not in cache for cache in full):
                break
            hashes.append(parent)
        h = len(hashes)
        while h > 0:
            miss = next((j for g, w in enumerate(self.windows) if w != FULL
                         for j in range(h - 1, self._first_in_window(h * bs, w) - 1, -1)
                         if hashes[j] not in self.group_cached[g]), None)
            if miss is None:
                break
            h = miss
        found: list[int] = []
        for g, w in enumerate(self.windows if h else ()):
            lo = 0 if w == FULL else self._first_in_window(h * bs, w)
            found += [NULL_BLOCK] * lo + [self.group_cached[g][x] for x in hashes[lo:h]]
        return found

    def _first_in_window(self, position: int, window: int) -> int:
        """The first block a query at `position` (and the lookback before it) reads in a sliding window."""
        return max(0, position - self.lookback - window + 1) // self.block_size

    def hit_tokens(self, shared: list[int]) -> int:
        """The tokens a prefix hit (find_cached_prefix's blocks) holds."""
        return len(shared) // self.num_groups * self.block_size

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_queries += num_tokens
        self.prefix_hits += num_hit_tokens

    def can_allocate(self, request_id: str, num_tokens: int, cached_blocks: list[int] | None = None) -> bool:
        """Whether allocate() would succeed."""
        cached_blocks = cached_blocks or []
        hit = len(cached_blocks) // self.num_groups
        need = self.blocks_needed(num_tokens) - len(self.tables.get(request_id, ())) - hit
        reuse_free = sum(1 for b in cached_blocks if self.blocks[b].ref_count == 0)
        return max(need, 0) * self.num_groups + reuse_free <= len(self.free)

    def allocate(self, request_id: str, num_tokens: int, cached_blocks: list[int] | None = None) -> list[int] | None:
        """Grow the request's table (each group's) to hold num_tokens; returns the block ids appended (group
        after group), or None if the pool is short (nothing changes then)."""
        table = self.tables.get(request_id)
        cached_blocks = cached_blocks or []
        hit = len(cached_blocks) // self.num_groups
        need = self.blocks_needed(num_tokens) - (len(table) if table is not None else 0) - hit
        if need <= 0 and not cached_blocks:
            return []  # the common decode step: the last block still has room
        if not self.can_allocate(request_id, num_tokens, cached_blocks):
            return None
        if table is None:
            table = self.tables[request_id] = []
            if self.hybrid:
                self.group_tables[request_id] = [table, *([] for _ in self.windows[1:])]
                self.window_start[request_id] = [0] * self.num_groups
        for block_id in cached_blocks:  # (every group's first: none of them may be taken as a free block)
            if not (self.hybrid and block_id == NULL_BLOCK):
                self.pin(block_id)
        added = []
        for g, group_table in enumerate(self.group_tables[request_id] if self.hybrid else (table,)):
            new = cached_blocks[g * hit:(g + 1) * hit] + [self._take_free() for _ in range(max(need, 0))]
            group_table += new
            added += new
        if cached_blocks and self.windows[0] == FULL:  # (the first group's hit blocks: each has its chain hash)
            self.hashes[request_id] = [self.blocks[b].block_hash for b in cached_blocks[:hit]]  # type: ignore[misc]
        return added

    def _take_free(self) -> int:
        block_id, _ = self.free.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:  # a cached block leaves the cache for another use
            self.group_cached[block.group].pop(block.block_hash, None)
            if self.events is not None and block.group == 0:
                self.events.append(BlockRemoved([block.block_hash]))
            block.block_hash = None
        block.ref_count = 1
        return block_id

    def free_outside_window(self, request_id: str, num_computed_tokens: int) -> None:
        """With sliding groups: the request's blocks no query from num_computed_tokens on reads (wholly before its
        window, less the lookback) go back to the pool, still cached; NULL_BLOCK takes their place."""
        tables = self.group_tables.get(request_id) if self.hybrid else None
        if tables is None:
            return
        starts = self.window_start[request_id]
        for g, w in enumerate(self.windows):
            if w == FULL:
                continue
            table, end = tables[g], self._first_in_window(num_computed_tokens, w)
            for i in range(starts[g], min(end, len(table))):
                if table[i] != NULL_BLOCK:
                    self.unpin(table[i])
                    table[i] = NULL_BLOCK
            starts[g] = max(starts[g], min(end, len(table)))

    def cache_full_blocks(self, request_id: str, token_ids: list[int], num_computed_tokens: int,
                          root: int | None = None) -> None:
        """Register the hashes of the request's blocks that are now full and computed (`root`: as in
        find_cached_prefix), in each group's prefix cache."""
        if not self.enable_prefix_caching:
            return
        hashes = self.hashes.setdefault(request_id, [])
        table = self.tables.get(request_id, [])
        tables = self.group_tables[request_id] if self.hybrid and table else (table,)
        full = min(num_computed_tokens // self.block_size, len(table))
        bs, stored = self.block_size, []
        for i in range(len(hashes), full):
            parent = hashes[-1] if hashes else root
            block_hash = chain_hash(parent, token_ids[i * bs:(i + 1) * bs])
            hashes.append(block_hash)
            for g, group_table in enumerate(tables):
                block, cache = self.blocks[group_table[i]], self.group_cached[g]
                if block.block_hash is not None or block_hash in cache:
                    continue  # (NULL_BLOCK is never registered: its hash is -1)
                block.block_hash, block.group = block_hash, g
                cache[block_hash] = block.block_id
                if g == 0:
                    stored.append(i)
                    if self.tiers is not None:
                        self.tiers.offer(block.block_id, block_hash)
        if stored and self.events is not None:  # one event per run of consecutive blocks, as vLLM sends them
            for run in _runs(stored):
                self.events.append(BlockStored([hashes[i] for i in run], hashes[run[0] - 1] if run[0] else None,
                                               token_ids[run[0] * bs:(run[-1] + 1) * bs]))

    def free_request(self, request_id: str) -> None:
        table = self.tables.pop(request_id, [])
        # tail blocks first, so a shared prefix outlives the request's own suffix in the cache
        for group_table in self.group_tables.pop(request_id, None) or (table,):
            for block_id in reversed(group_table):
                if not (self.hybrid and block_id == NULL_BLOCK):
                    self.unpin(block_id)
        self.window_start.pop(request_id, None)
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
