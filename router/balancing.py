"""Load-balancing policies over healthy replicas: pick(replicas, prompt, root) -> one of them. root (the request's
EngineRequest.hash_root: None, or its LoRA adapter's and cache salt's) keys what a cache-aware policy matches:
KV cached under one root is no other root's."""
from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Mapping

from router.kv_index import KVAware


class LeastLoad:
    """Fewest waiting * 4 + running (from the schedulers' stats, plus what was sent since)."""

    def pick(self, replicas, prompt, root: int | None = None):
        return min(replicas, key=lambda r: r.load)


class RoundRobin:
    def __init__(self):
        self._counter = itertools.count()

    def pick(self, replicas, prompt, root: int | None = None):
        return replicas[next(self._counter) % len(replicas)]


class CacheAware:
    """Send a prompt where its prefix most likely sits in the KV cache (SGLang's idea):
    an approximate per-replica record of routed prompt-prefix blocks; when the load is
    unbalanced, or nothing matches enough, fall back to the least loaded replica."""

    def __init__(self, block: int = 16, min_match: float = 0.5, balance_abs: int = 32, balance_rel: float = 1.5,
                 capacity: int = 100_000):
        self.block, self.min_match = block, min_match
        self.balance_abs, self.balance_rel = balance_abs, balance_rel
        self.capacity = capacity
        self.seen: dict[str, OrderedDict[int, None]] = {}
        self.fallback = LeastLoad()

    def _prefixes(self, prompt: list[int], root: int | None = None) -> list[int]:
        return [hash((root, tuple(prompt[:end]))) for end in range(self.block, len(prompt) + 1, self.block)]

    def pick(self, replicas, prompt, root: int | None = None):
        loads = [r.load for r in replicas]
        unbalanced = max(loads) - min(loads) > self.balance_abs and max(loads) > self.balance_rel * max(min(loads), 1)
        prefixes = self._prefixes(prompt, root)
        choice = None
        if prefixes and not unbalanced:
            scores = [(self._matched(r.address, prefixes), -r.load, i) for i, r in enumerate(replicas)]
            best = max(scores)
            if best[0] / len(prefixes) >= self.min_match:
                choice = replicas[best[2]]
        choice = choice or self.fallback.pick(replicas, prompt)
        self._record(choice.address, prefixes)
        return choice

    def _matched(self, address: str, prefixes: list[int]) -> int:
        seen: Mapping[int, None] = self.seen.get(address, {})
        n = 0
        for h in prefixes:
            if h not in seen:
                break
            n += 1
        return n

    def _record(self, address: str, prefixes: list[int]) -> None:
        seen = self.seen.setdefault(address, OrderedDict())
        for h in prefixes:
            seen[h] = None
            seen.move_to_end(h)
        while len(seen) > self.capacity:
            seen.popitem(last=False)


POLICIES = {"least-load": LeastLoad, "round-robin": RoundRobin, "cache-aware": CacheAware, "kv-aware": KVAware}
