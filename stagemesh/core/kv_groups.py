"""The KV cache groups of a model whose layers attend differently: vLLM's hybrid KV cache manager.

A model with sliding-window layers beside full-attention ones (Gemma 3: five local layers to one global;
gpt-oss: alternating) needs a local layer's keys only for the last `sliding_window` positions. Its layers are
put in groups of at most S, each group of one kind, where S is the smaller count (Gemma 3's global layers; half
of gpt-oss's): the full layers' groups first, then the sliding ones', each kind's layers dealt to its groups in
turn so that every group spans the model's depth (a pipeline stage then holds its share of each group).
Every group has its own block table per request, all drawing from one pool of blocks, and a block of the pool
holds, on each stage, the KV of one layer of every group: the layers are laid on S "slots", the i-th layer of
each group on the i-th slot. So a block is S layers' KV, not all of them, and the pool holds num_layers / S
times the blocks.

A full group's table grows with the sequence; a sliding group's blocks that fall wholly out of its window go
back to the pool (scheduler.block_manager), and its table keeps NULL_BLOCK in their place, which no step reads
(kernels.masked_attention reads from the window's first position). A long context then costs a full group's
blocks plus a window's worth per sliding group, about S / num_layers of what full attention on every layer
would.

Models without sliding layers have one group, every layer on its own slot: the plain paged cache.
--disable-hybrid-kv-cache-manager (vLLM's flag) keeps that for any model: the windows are then only a mask.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from stagemesh.core.model_config import ModelConfig

NULL_BLOCK = 0  # with several groups: the block id a freed sliding block leaves in its table; never handed out
FULL = 0  # a group's window when its layers attend to every position


@dataclass(frozen=True)
class KVGroups:
    windows: tuple[int, ...]  # per group: its layers' sliding window, FULL (0) for full attention
    layer_group: tuple[int, ...]  # per layer of the model: its group

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def hybrid(self) -> bool:
        """Whether blocks are freed out of a window (and a block holds fewer layers than the stage has)."""
        return any(self.windows)

    def slots(self, start: int, end: int) -> list[int]:
        """Each layer of [start, end)'s slot on a stage that holds those layers: its index among its group's
        layers there (every layer its own when not hybrid)."""
        if not self.hybrid:
            return list(range(end - start))
        seen = [0] * self.num_groups
        slots = []
        for layer in range(start, end):
            g = self.layer_group[layer]
            slots.append(seen[g])
            seen[g] += 1
        return slots

    def num_slots(self, start: int, end: int) -> int:
        """The layers' KV one block holds on a stage with layers [start, end)."""
        return max(self.slots(start, end), default=-1) + 1


def plain(num_layers: int) -> KVGroups:
    return KVGroups((FULL,), (0,) * num_layers)


def kv_groups(cfg: ModelConfig, disable_hybrid: bool = False) -> KVGroups:
    """The model's groups: one per S layers of a kind where it has sliding layers (unless disable_hybrid), else
    the one plain group."""
    n, family = cfg.num_hidden_layers, cfg.family
    window = cfg.sliding_window or 0
    if disable_hybrid or family.layer_types is None or window <= 0:
        return plain(n)
    sliding = [kind == "sliding_attention" for kind in family.layer_types(cfg.raw)]
    full_layers = [i for i in range(n) if not sliding[i]]
    sliding_layers = [i for i in range(n) if sliding[i]]
    if not sliding_layers:
        return plain(n)
    size = min(len(full_layers), len(sliding_layers)) if full_layers else len(sliding_layers)
    windows: list[int] = []
    layer_group = [0] * n
    for layers, kind_window in ((full_layers, FULL), (sliding_layers, window)):
        count = -(-len(layers) // size)  # groups of this kind, dealt its layers in turn: each spans the depth,
        for k, layer in enumerate(layers):  # so a pipeline stage holds about its share of every group
            layer_group[layer] = len(windows) + k % count
        windows += [kind_window] * count
    return KVGroups(tuple(windows), tuple(layer_group))


def blocks_at_most(windows: tuple[int, ...], num_tokens: int, block_size: int, chunk: int, lookback: int = 0) -> int:
    """The most blocks a request of num_tokens holds at once, over every group: a full group's table whole, a
    sliding group's the blocks of its window, the chunk computed, and the lookback kept for speculation."""
    whole = -(-num_tokens // block_size)
    return sum(whole if w == FULL else min(whole, -(-(w - 1 + lookback + chunk) // block_size) + 1)
               for w in windows)


def usable_blocks(windows: tuple[int, ...], num_blocks: int) -> int:
    """The pool's blocks a request may have: all but NULL_BLOCK where sliding groups free blocks."""
    return num_blocks - (1 if any(windows) else 0)


def tokens_held(windows: tuple[int, ...], num_blocks: int, block_size: int, chunk: int, lookback: int = 0) -> int:
    """The most tokens one request's KV can hold in a pool of num_blocks (the KV cache size a replica states)."""
    usable = usable_blocks(windows, num_blocks)
    if not any(windows):
        return usable // len(windows) * block_size
    if FULL not in windows:  # (every layer sliding: a request holds its windows whatever its length)
        return 1 << 40
    lo, hi = 0, usable  # the most blocks of a full table that fit, by bisection
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if blocks_at_most(windows, mid * block_size, block_size, chunk, lookback) <= usable:
            lo = mid
        else:
            hi = mid - 1
    return lo * block_size
