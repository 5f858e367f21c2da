"""The routers of one serve share their metrics (router.metrics, router.metrics_shared: prometheus_client's
multiprocess mode): real router-like processes that count requests into one directory, one killed and started
again, and the page any of them would serve read from it. The serve mesh's own check (every scrape through
--api-server-count 2 counts all requests) is in test_api_servers.py."""
from __future__ import annotations

import os
import subprocess
import sys

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

COUNTING = """
import sys
from router import observe
from stagemesh.v1 import scheduler_pb2

requests, queries = int(sys.argv[1]), int(sys.argv[2])
observe.configure("m", 64)
observe.replica_state("r:1", True, scheduler_pb2.Stats(prefix_cache_queries=queries, num_running=requests))
for i in range(requests):
    record = observe.RequestRecord(f"req-{i}", 3, 4)
    record.replica = "r:1"
    record.tokens(1)
    record.done(4, "stop")
observe.RequestRecord("in-flight", 3, 4)  # one it is serving when it dies
print("counted", flush=True)
sys.stdin.read()  # (until the test ends it)
"""


def _router(directory, requests: int, queries: int) -> subprocess.Popen:
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(directory)}
    proc = subprocess.Popen([sys.executable, "-c", COUNTING, str(requests), str(queries)], env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "counted"
    return proc


def _page(directory) -> dict[str, float]:
    """The merged page's samples (summed over their labels), by sample name."""
    from router.metrics_shared import shared_registry

    page = generate_latest(shared_registry(str(directory))).decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(page):
        for sample in family.samples:
            out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


def test_routers_sharing_their_metrics_count_every_request_and_no_counter_goes_back(tmp_path):
    a, b = _router(tmp_path, 4, 100), _router(tmp_path, 6, 150)
    try:
        page = _page(tmp_path)
        assert page["vllm:request_success_total"] == 10 and page["stagemesh:router_requests_in_flight"] == 2
        # every router reads the same replica's counts: the page shows them once, as a counter
        assert page["vllm:prefix_cache_queries_total"] == 150 and "vllm:prefix_cache_queries" not in page
        assert page["vllm:num_requests_running"] in (4, 6)  # the latest any router saw
        a.kill()
        a.wait()
        page = _page(tmp_path)  # a router SIGKILLed: its counts stay, its requests in flight go
        assert page["vllm:request_success_total"] == 10 and page["stagemesh:router_requests_in_flight"] == 1
        assert page["vllm:prefix_cache_queries_total"] == 150
        a = _router(tmp_path, 1, 150)  # started again: it counts on top of what the dead one counted
        page = _page(tmp_path)
        assert page["vllm:request_success_total"] == 11 and page["vllm:prefix_cache_queries_total"] == 150
        assert page["vllm:e2e_request_latency_seconds_count"] == 11
    finally:
        for proc in (a, b):
            proc.kill()
            proc.wait()
