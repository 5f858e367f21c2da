"""The /metrics page of a router whose series are shared with the other routers of its serve (router.metrics:
prometheus_client's multiprocess mode, PROMETHEUS_MULTIPROC_DIR): whichever router answers, the page counts
every router's requests, those of routers that died or were restarted too, so no counter goes back within one
serve. vLLM's API servers (--api-server-count) share theirs the same way.

Three things prometheus_client's MultiProcessCollector leaves to its user are done here: a router that died
without a word (SIGKILL) has its live gauges' files removed (mark_process_dead) when a page is made; the engine
counters, kept as gauges merged by their maximum (router.metrics.engine_counter), are shown as the counters they
are; and each process's own collectors (CPU, memory, GC) are left out, as they describe one process only.
"""
from __future__ import annotations

import glob
import os
import re
from typing import Iterable

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead
from prometheus_client.samples import Sample

from router import metrics as m

_LIVE_FILE = re.compile(r"gauge_live\w+?_(\d+)\.db$")


class SharedCollector:
    """Every router's series from the shared directory, merged."""

    def __init__(self, path: str):
        self.path = path
        self.files = MultiProcessCollector(None, path)

    def collect(self) -> Iterable[Metric]:
        forget_dead_routers(self.path)
        for metric in self.files.collect():
            yield as_counter(metric) if metric.name in m.ENGINE_COUNTERS else metric


def forget_dead_routers(path: str) -> None:
    """The live gauges of processes that are gone (a router SIGKILLed) no longer count."""
    pids = {int(match[1]) for f in glob.glob(os.path.join(path, "gauge_live*.db"))
            if (match := _LIVE_FILE.search(os.path.basename(f)))}
    for pid in pids:
        if not _alive(pid):
            mark_process_dead(pid, path)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def as_counter(metric: Metric) -> Metric:
    """An engine counter's merged gauge as the counter it stands for (vLLM's `_total` samples)."""
    counter = Metric(metric.name, metric.documentation, "counter")
    counter.samples = [Sample(s.name + "_total", s.labels, s.value, s.timestamp, s.exemplar) for s in metric.samples]
    return counter


def shared_registry(path: str) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(SharedCollector(path))
    return registry
