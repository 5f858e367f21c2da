"""KV accounting: the blocks of the pool a request holds and needs for its next chunk, and, for a waiting
request at the head of the queue, where its KV comes from (scheduler.kv_sources): a prefill replica that holds
its prompt, the KV tiers, or the prefix cache.

Decisions about who runs and who is preempted are not made here (scheduler.policy); this module answers
"how many blocks", "are there enough", and "which source has them".
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final, Literal

from scheduler.block_manager import BlockManager
from scheduler.kv_sources import Found, KVSource
from scheduler.kv_transfer import KVTransfers
from scheduler.request import Request
from scheduler.speculation import Speculator
from scheduler.status import Status
from scheduler.tiers import LoadJob
from stagemesh.core.engine_request import KVSourceInfo


class PrefixCache:
    """The pool's cached blocks (scheduler.block_manager's hash chains) as a KV source: shared, never copied."""

    def __init__(self, kv: BlockManager):
        self.kv = kv

    def find(self, request: Request, shared: list[int]) -> Found | None:
        # a request that scores or pools its prompt needs every position computed: no prefix-cache hit (as vLLM)
        if request.sampling.computes_whole_prompt:
            return None
        cached = self.kv.find_cached_prefix(request.all_token_ids, request.hash_root)
        return Found(self.kv.hit_tokens(cached), cached) if cached else None

    def bring(self, request: Request, block_ids: list[int], found: Found) -> None:
        pass  # (its blocks hold the KV already: allocating them shares them)


@dataclass(frozen=True)
class Placement:
    """A waiting request's first chunk placed in the pool: the tokens its blocks hold already (prefix hits, or
    KV loaded into them), the tokens it computes now, and the blocks the stages are told of."""
    num_cached: int
    num_new: int
    new_blocks: list[int]


BROUGHT: Final = "brought"  # place(): a source copies the request's KV in; it left the queue until that ends


class KVAccounting:
    def __init__(self, kv: BlockManager, transfers: KVTransfers, spec: Speculator | None):
        self.kv, self.spec = kv, spec
        self.prefix = PrefixCache(kv)
        # the sources that copy KV in, asked in this order: a prefill replica's pull, then the tiers
        self.remote: tuple[KVSource, ...] = (transfers, *((kv.tiers,) if kv.tiers is not None else ()))

    def kv_tokens(self, request: Request, num_new: int, num_drafts: int, start: int | None = None) -> int:
        """The tokens the request's KV blocks must hold for a chunk of num_new tokens from `start` (its
        num_computed_tokens), with a draft model's lookahead when the chunk samples."""
        end = (request.num_computed_tokens if start is None else start) + num_new
        if self.spec is not None and end - num_drafts >= request.num_tokens + request.num_output_placeholders:
            return self.spec.lookahead(request, end)
        return end

    def fits(self, head: Request, tokens: int) -> bool:
        """Whether the waiting request's first chunk (of at most `tokens`) has blocks now."""
        cached = self._shared(head)
        return self.kv.can_allocate(head.request_id, self._first_chunk_end(head, tokens, cached), cached)

    def kv_source_fits(self, src: KVSourceInfo, request: Request) -> bool:
        """The held KV is exactly that of the request's tokens but the last (the prompt's, with its first token
        after it; or a migrated request's, with the tokens it generated), in blocks of this replica's size; not
        with a draft model, whose own KV cache mirrors only what the target computes here; not with KV cache
        groups (a table per group: not carried)."""
        if self.kv.hybrid or (self.spec is not None and self.spec.config.uses_draft_model):
            return False
        return (src.block_size == self.kv.block_size and src.num_tokens == request.num_tokens - 1
                and len(src.block_ids) == self.kv.blocks_needed(src.num_tokens) and bool(request.output_token_ids)
                and not request.sampling.computes_whole_prompt)

    def holds_loaded_kv(self, request: Request) -> bool:
        """Whether the waiting request's blocks hold its prompt's KV, brought by a source (pulled, or loaded from
        a tier): the only waiting requests that hold blocks (a preempted one gave its own back)."""
        return request.request_id in self.kv.tables

    def place(self, request: Request, tokens: int) -> Placement | Literal["brought"] | None:
        """Blocks for the waiting request's first chunk (at most `tokens`), its KV taken from where it is: a
        Placement; BROUGHT: a source started copying its KV in; None: the pool lacks the blocks."""
        if self.holds_loaded_kv(request):  # the stages get every one of its blocks
            num_cached = request.num_computed_tokens
            num_new = min(request.num_tokens - num_cached, tokens)
            if self.kv.allocate(request.request_id, self.kv_tokens(request, num_new, 0, num_cached)) is None:
                return None
            return Placement(num_cached, num_new, list(self.kv.tables[request.request_id]))
        shared = self._shared(request)
        for source in self.remote:
            found = source.find(request, shared)
            if found is None:
                continue
            blocks = self.kv.allocate(request.request_id, found.num_tokens, found.shared)
            if blocks is None:
                if found.only:
                    return None
                continue  # no room to load into yet: computed, or looked up again when there is room
            source.bring(request, blocks[len(found.shared):], found)
            return BROUGHT
        num_cached = self.kv.hit_tokens(shared)
        num_new = self._first_chunk_end(request, tokens, shared) - num_cached
        new_blocks = self.kv.allocate(request.request_id, self.kv_tokens(request, num_new, 0, num_cached), shared)
        return Placement(num_cached, num_new, new_blocks) if new_blocks is not None else None

    def _shared(self, request: Request) -> list[int]:
        found = self.prefix.find(request, [])
        return found.shared if found is not None else []

    def _first_chunk_end(self, request: Request, tokens: int, cached: list[int]) -> int:
        """The tokens the waiting request's first chunk fills, counted from position 0."""
        num_cached = self.kv.hit_tokens(cached)
        return num_cached + min(request.num_tokens - num_cached, tokens)

    def give_back_loaded(self, waiting: Iterable[Request]) -> bool:
        """Waiting requests whose KV was brought into blocks of their own give them back, still in the prefix
        cache, to be admitted like any request (their prefix found there); whether any did."""
        held = [r for r in waiting if self.holds_loaded_kv(r)]
        for r in held:
            self.kv.free_request(r.request_id)
            r.num_computed_tokens, r.tiers_checked = 0, False
        return bool(held)

    def tier_loaded(self, job: LoadJob, flags: list[bool]) -> Request | None:
        """A load from the KV tiers ended (flags: per block, loaded): its request, to run from the first block
        that did not load; None when it ended meanwhile (its blocks freed now) or is not this pool's."""
        tiers = self.kv.tiers
        if tiers is None or job.request_id not in tiers.loading:
            return None
        good = tiers.loaded(job, flags)
        request = tiers.loading.pop(job.request_id)
        if request is None:  # it ended during the load: only now may its blocks go to another request
            self.kv.free_request(job.request_id)
            return None
        num_pooled = len(self.kv.tables[job.request_id]) - len(job.block_ids)
        request.num_computed_tokens = (num_pooled + good) * self.kv.block_size
        self.kv.cache_full_blocks(job.request_id, request.all_token_ids, request.num_computed_tokens,
                                  request.hash_root)
        request.status = Status.WAITING
        return request
