"""A stage's KV tier counters on its /metrics (stage_worker.kv_tiers, rank 0's), read when scraped."""
from __future__ import annotations

from prometheus_client import REGISTRY
from prometheus_client.core import CounterMetricFamily


class KVTierCollector:
    """The stage's KV tiers (stage_worker.kv_tiers, rank 0's), read when scraped: stagemesh:stage_kv_tier_blocks
    {stage, event} (stored, loaded from host or disk, refused) and stagemesh:stage_kv_disk_blocks{stage, event}
    (written, dropped: the write queue or the disk full, read hits and misses, full-disk pauses, errors)."""

    def __init__(self, stage_index: int, tiers):
        self._stage, self._tiers = str(stage_index), tiers

    def collect(self):
        blocks = CounterMetricFamily("stagemesh:stage_kv_tier_blocks", "KV blocks this stage's rank 0 copied into its "
                                     "host tier (stored), back from it or from disk (loaded_host, loaded_disk), or "
                                     "could not load (refused: another block in the slot, a bad or missing file)",
                                     labels=["stage", "event"])
        t = self._tiers.stats
        for event, n in (("stored", t.stored), ("loaded_host", t.loaded_host), ("loaded_disk", t.loaded_disk),
                         ("refused", t.refused)):
            blocks.add_metric([self._stage, event], n)
        yield blocks
        disk = self._tiers.disk
        if disk is not None:
            family = CounterMetricFamily("stagemesh:stage_kv_disk_blocks", "Block files of this stage's rank 0's disk "
                                         "tier: written, dropped (the write queue or the disk full), read hits and "
                                         "misses (missing, truncated, corrupt, foreign), full-disk pauses, errors",
                                         labels=["stage", "event"])
            d = disk.stats
            for event, n in (("written", d.written), ("dropped", d.dropped), ("read_hits", d.read_hits),
                             ("read_misses", d.read_misses), ("full_pauses", d.full_pauses), ("errors", d.errors)):
                family.add_metric([self._stage, event], n)
            yield family


def watch_kv_tiers(stage_index: int, tiers) -> None:
    REGISTRY.register(KVTierCollector(stage_index, tiers))
