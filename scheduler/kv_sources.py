"""Where a waiting request's KV may already be, behind one interface: the prefix cache (the pool's own blocks,
scheduler.kv_accounting.PrefixCache), the host and disk tiers below the pool (scheduler.tiers.KVTiers), and a
prefill replica that holds its prompt's KV (scheduler.kv_transfer.KVTransfers, disaggregated prefill's pull).

The scheduler asks each source the same two things: which of the request's tokens it holds (find), and to
bring them into blocks allocated for them (bring). The prefix cache's blocks are shared, not copied; a tier's
and a prefill replica's are copied by the stages while the request waits out of the queue
(Status.WAITING_FOR_REMOTE_KV) and comes back with its blocks holding them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from scheduler.request import Request


@dataclass(frozen=True)
class Found:
    """What a source holds of a request's tokens: its blocks hold num_tokens (from position 0) once brought;
    `shared`: the pool's blocks that hold the first of them already (the prefix cache's); `hits`: what the
    source needs to bring the rest (a tier's (block hash, host slot) pairs); `only`: the request's KV can come
    from nowhere else (a prefill replica holds its prompt), so without blocks for it, it waits."""
    num_tokens: int
    shared: list[int] = field(default_factory=list)
    hits: list[tuple[int, int]] = field(default_factory=list)
    only: bool = False


class KVSource(Protocol):
    def find(self, request: Request, shared: list[int]) -> Found | None:
        """The request's tokens this source holds past the pool's `shared` blocks (the prefix cache's hits);
        None: none (or it is not asked for this request)."""
        ...

    def bring(self, request: Request, block_ids: list[int], found: Found) -> None:
        """Fill `block_ids`, allocated to the request past found.shared, with what `found` found (a copying
        source starts the copy; the request leaves the waiting queue until it ends)."""
        ...
