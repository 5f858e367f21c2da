"""What a scheduler reports of itself (GetStats, WatchStats and the replica's metrics): its queues, its KV cache and
prefix cache, its preemptions, speculative decoding's figures, the KV tiers, the adapters in use and the tenants'
queue waits."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

from scheduler.block_manager import BlockManager
from scheduler.config import SchedulerConfig
from scheduler.policy import WaitingQueue
from scheduler.request import Request
from scheduler.speculation import SpecDecodeStats, Speculator


@dataclass
class SchedulerStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_kv_blocks: int
    num_preemptions: int = 0
    spec_decode: SpecDecodeStats | None = None  # with --speculative-config
    tier_blocks: dict[str, int] = field(default_factory=dict)  # KV tier -> blocks it holds (scheduler.tiers)
    # --enable-lora: the adapters of the running and of the waiting requests (vLLM's lora_requests_info)
    running_adapters: tuple[str, ...] = ()
    waiting_adapters: tuple[str, ...] = ()
    queue_wait: dict[str, float] = field(default_factory=dict)  # tenant -> its oldest waiting request's wait, s


class Reported(Protocol):
    """What the stats read of a scheduler (scheduler.scheduler.Scheduler)."""
    config: SchedulerConfig
    running: list[Request]
    waiting: WaitingQueue
    kv: BlockManager
    spec: Speculator | None
    num_preemptions: int


def snapshot(s: Reported) -> SchedulerStats:
    """Scheduler.stats: the scheduler's figures now."""
    tiers = s.kv.tiers
    return SchedulerStats(len(s.running), len(s.waiting), s.kv.usage, s.kv.prefix_queries,
                          s.kv.prefix_hits, s.kv.num_blocks, s.num_preemptions,
                          s.spec.stats if s.spec is not None else None,
                          {"host": len(tiers.host), "disk": len(tiers.disk)} if tiers is not None else {},
                          *_adapters(s), s.waiting.oldest_waits(time.monotonic()))


def _adapters(s: Reported) -> tuple[tuple[str, ...], tuple[str, ...]]:
    if s.config.lora is None:
        return (), ()
    return (tuple(sorted({r.lora_name for r in s.running if r.lora_name})),
            tuple(sorted({r.lora_name for r in s.waiting if r.lora_name})))
