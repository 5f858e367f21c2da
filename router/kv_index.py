"""A global index of which replica holds which KV blocks, fed by the replicas' KV events, and the
`kv-aware` policy that routes by it.

Blocks are named by their chained hashes (stagemesh.core.block_hash), so the index is flat: a prompt's
leading blocks are cached on a replica exactly as far as their hashes are in that replica's set (a
hash names a block and every block before it: the radix tree is in the hashes). Each replica's set
follows its scheduler's events: BlockStored adds, BlockRemoved drops, AllBlocksCleared (a new epoch, a
restart, every new subscription's snapshot) empties it, and so does losing the event stream.
"""
from __future__ import annotations

from stagemesh.core.block_hash import prefix_hashes


class KVIndex:
    def __init__(self):
        self.blocks: dict[str, set[int]] = {}  # replica address -> hashes of its cached blocks
        self.block_sizes: dict[str, int] = {}

    def stored(self, address: str, block_hashes, block_size: int) -> None:
        self.blocks.setdefault(address, set()).update(block_hashes)
        if block_size > 0:
            self.block_sizes[address] = block_size

    def removed(self, address: str, block_hashes) -> None:
        self.blocks.get(address, set()).difference_update(block_hashes)

    def clear(self, address: str) -> None:
        self.blocks.pop(address, None)

    def num_blocks(self, address: str) -> int:
        return len(self.blocks.get(address, ()))

    def matched_tokens(self, address: str, prompt: list[int], hashes_by_size: dict[int, list[int]]) -> int:
        """How many leading tokens of the prompt the replica holds (whole blocks); hashes_by_size caches the
        prompt's hashes per block size across the replicas of one decision."""
        cached = self.blocks.get(address)
        size = self.block_sizes.get(address)
        if not cached or not size:
            return 0
        if size not in hashes_by_size:
            hashes_by_size[size] = prefix_hashes(prompt, size)
        n = 0
        for h in hashes_by_size[size]:
            if h not in cached:
                break
            n += 1
        return n * size


class KVAware:
    """The replica whose cache holds the most of the prompt's leading tokens (as its KV events tell), among
    the replicas that are not much busier than the least loaded one; the least loaded when none holds any."""

    def __init__(self, index: KVIndex | None = None, balance_abs: int = 32, balance_rel: float = 1.5):
        self.index = index or KVIndex()
        self.balance_abs, self.balance_rel = balance_abs, balance_rel
        self.last_matched_tokens = 0  # of the latest decision (metrics)

    def pick(self, replicas, prompt):
        least = min(replicas, key=lambda r: r.load)
        hashes: dict[int, list[int]] = {}
        best, best_matched = least, 0
        for r in replicas:
            if r.load - least.load > self.balance_abs and r.load > self.balance_rel * max(least.load, 1):
                continue  # a cache hit does not pay for a long queue
            matched = self.index.matched_tokens(r.address, prompt, hashes)
            if matched > best_matched or (matched == best_matched and matched and r.load < best.load):
                best, best_matched = r, matched
        self.last_matched_tokens = best_matched
        return best
