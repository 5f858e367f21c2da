"""The router's Prometheus series, in its own registry (served at /metrics on its HTTP port).

vLLM's series under vLLM's names (`vllm:`), labels and buckets, so that vLLM's Grafana dashboard and
alerts work against the gateway alone: `model_name` is the served name and `engine` the replica's index in
the router's --replica list (vLLM's data-parallel rank). The engine state (running, waiting, KV usage,
prefix cache, preemptions, speculative decoding's acceptance) comes from each scheduler's statistics stream;
the request series (tokens, finish reasons, latencies) are measured here, where every request passes. The
`stagemesh:router_*` series are the router's own (which replica served what, replays, health), by replica address.

The schedulers' and stages' own pages (--metrics-port) keep the `stagemesh:` prefix: a Prometheus that
scrapes every service then counts no request twice under vLLM's names.

The routers of one `stagemesh serve` (--api-server-count N, and every router restarted in it) share their
series as vLLM's API servers do: prometheus_client's multiprocess mode, each process's values in files of the
directory serve gives them (PROMETHEUS_MULTIPROC_DIR), every /metrics page the sum over all of them
(router.metrics_shared). Gauges say how they merge (MERGE_*); the engine counters, which every router counts
from the same statistics stream, merge by their maximum.
"""
from __future__ import annotations

import os
from typing import Any

from prometheus_client import (GC_COLLECTOR, PLATFORM_COLLECTOR, PROCESS_COLLECTOR, CollectorRegistry, Counter, Gauge,
                               Histogram)

# vLLM's buckets (vllm/v1/metrics/loggers.py): the dashboard's quantiles are read from them
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_GAP_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                     40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0)
N_BUCKETS = (1, 2, 5, 10, 20)
_ROUTER_LATENCY = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E = ["model_name", "engine"]

# the router's own registry: a process that imports both the router and the scheduler (a test, an
# embedding application) must not see series of the same name collide
REGISTRY = CollectorRegistry()
for _collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
    REGISTRY.register(_collector)
R: dict[str, Any] = dict(registry=REGISTRY)
# set (by serve) before prometheus_client was imported: values live in files there, shared by the routers
MULTIPROC_DIR = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
if MULTIPROC_DIR:  # (before the first series is made: its file goes there)
    os.makedirs(MULTIPROC_DIR, exist_ok=True)
# how a gauge merges over the routers: the latest value any live router set (the same replica's state, as each
# router reads it from the same stream), or the sum over live routers (what each serves now)
MERGE_LATEST: dict[str, Any] = dict(multiprocess_mode="livemostrecent", **R)
MERGE_SUM: dict[str, Any] = dict(multiprocess_mode="livesum", **R)
# engine counters merged by their maximum (router.metrics_shared shows them as counters): every router adds the
# same scheduler's counts, so a sum would count them once per router; a dead router's stays, so none goes back
ENGINE_COUNTERS = frozenset({"vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:num_preemptions",
                             "vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                             "vllm:spec_decode_num_accepted_tokens", "vllm:spec_decode_num_accepted_tokens_per_pos"})


def engine_counter(name: str, documentation: str, labels: list[str]) -> Any:
    """A counter of a replica's own counts (as its scheduler's stats stream reports them): a Counter in one
    process, a gauge merged by its maximum when routers share their series."""
    assert name in ENGINE_COUNTERS  # (what the shared page shows as a counter)
    if not MULTIPROC_DIR:
        return Counter(name, documentation, labels, **R)
    return Gauge(name, documentation, labels, multiprocess_mode="max", **R)


def buckets_1_2_5(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's buckets for token counts)."""
    out: list[int] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return out
            out.append(m * scale)
        scale *= 10


# -- vLLM's engine state, per replica, from its scheduler's stats ------------------------------------------
RUNNING = Gauge("vllm:num_requests_running", "Number of requests in model execution batches.", E, **MERGE_LATEST)
WAITING = Gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", E, **MERGE_LATEST)
KV_USAGE = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", E, **MERGE_LATEST)
PREFIX_QUERIES = engine_counter("vllm:prefix_cache_queries",
                                "Prefix cache queries, in terms of number of queried tokens.", E)
PREFIX_HITS = engine_counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", E)
PREEMPTIONS = engine_counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.", E)


class SpecDecodeCounters:
    """Speculative decoding's four families (vllm/v1/spec_decode/metrics.py), registered when the first replica
    reports that it speculates (--speculative-config): as vLLM, a gateway whose replicas do not declares none."""
    _made: "SpecDecodeCounters | None" = None

    def __init__(self) -> None:
        self.drafts = engine_counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", E)
        self.draft_tokens = engine_counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", E)
        self.accepted = engine_counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.", E)
        self.accepted_per_pos = engine_counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                               "Accepted tokens per draft position.", [*E, "position"])

    @classmethod
    def get(cls) -> "SpecDecodeCounters":
        if cls._made is None:
            cls._made = cls()
        return cls._made

class LoRAInfo:
    """vLLM's vllm:lora_requests_info (vllm/v1/metrics/loggers.py): per replica, one series whose labels are its
    --max-loras and its waiting and running adapters (comma-separated), set to the time of the update. Registered
    when the first replica reports LoRA: as vLLM, a gateway whose replicas serve none declares none."""
    _made: "LoRAInfo | None" = None

    def __init__(self) -> None:
        self.gauge = Gauge("vllm:lora_requests_info", "Running stats on lora requests.",
                           [*E, "max_lora", "waiting_lora_adapters", "running_lora_adapters"], **MERGE_LATEST)
        self.current: dict[tuple[str, ...], tuple[str, ...]] = {}  # (model, engine) -> its series' labels

    @classmethod
    def get(cls) -> "LoRAInfo":
        if cls._made is None:
            cls._made = cls()
        return cls._made

    def set(self, labels: tuple[str, ...], max_loras: int, waiting: list[str], running: list[str]) -> None:
        now = (*labels, str(max_loras), ",".join(waiting), ",".join(running))
        before = self.current.get(labels)
        if before is not None and before != now and not MULTIPROC_DIR:  # one series per replica: the old
            # labels' goes (shared between routers it stays, with its older time, as vLLM's API servers leave it)
            self.gauge.remove(*before)
        self.current[labels] = now
        self.gauge.labels(*now).set_to_current_time()


# -- vLLM's request series, measured at the router ------------------------------------------------------
PROMPT = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", E, **R)
GENERATION = Counter("vllm:generation_tokens", "Number of generation tokens processed.", E, **R)
SUCCESS = Counter("vllm:request_success", "Count of successfully processed requests.", [*E, "finished_reason"], **R)
N_PARAM = Histogram("vllm:request_params_n", "Histogram of the n request parameter.", E, buckets=N_BUCKETS, **R)
TTFT = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", E,
                 buckets=TTFT_BUCKETS, **R)
ITL = Histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", E,
                buckets=TOKEN_GAP_BUCKETS, **R)
TPOT = Histogram("vllm:request_time_per_output_token_seconds",
                 "Histogram of time_per_output_token_seconds per request.", E, buckets=TOKEN_GAP_BUCKETS, **R)
E2E = Histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", E,
                buckets=REQUEST_BUCKETS, **R)
QUEUE = Histogram("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.", E,
                  buckets=REQUEST_BUCKETS, **R)
INFERENCE = Histogram("vllm:request_inference_time_seconds", "Histogram of time spent in RUNNING phase for request.",
                      E, buckets=REQUEST_BUCKETS, **R)
PREFILL = Histogram("vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request.", E,
                    buckets=REQUEST_BUCKETS, **R)
DECODE = Histogram("vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.", E,
                   buckets=REQUEST_BUCKETS, **R)


class TokenHistograms:
    """vLLM's token-count histograms, whose buckets end at the context length (known at start-up)."""

    def __init__(self, max_model_len: int):
        b = dict(buckets=buckets_1_2_5(max_model_len), **R)
        self.prompt = Histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.", E, **b)
        self.generation = Histogram("vllm:request_generation_tokens", "Number of generation tokens processed.", E, **b)
        self.max_generation = Histogram("vllm:request_max_num_generation_tokens",
                                        "Histogram of maximum number of requested generation tokens.", E, **b)
        self.max_tokens = Histogram("vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.",
                                    E, **b)


# -- the router's own ---------------------------------------------------------------------------------
REQUESTS = Counter("stagemesh:router_requests", "Requests finished, by replica and finish reason",
                   ["replica", "finished_reason"], **R)
PROMPT_TOKENS = Counter("stagemesh:router_prompt_tokens", "Prompt tokens of finished requests", ["replica"], **R)
GENERATION_TOKENS = Counter("stagemesh:router_generation_tokens", "Tokens generated", ["replica"], **R)
ROUTER_TTFT = Histogram("stagemesh:router_time_to_first_token_seconds", "Time to first token seen by the router",
                        buckets=_ROUTER_LATENCY, **R)
REPLAYS = Counter("stagemesh:router_request_replays",
                  "Requests sent again after their replica failed: before their first token (a retry) or as a "
                  "continuation of the tokens already streamed", ["kind"], **R)
ROUTER_E2E = Histogram("stagemesh:router_e2e_request_latency_seconds", "Request latency seen by the router",
                       buckets=_ROUTER_LATENCY, **R)
HEALTHY = Gauge("stagemesh:router_replica_healthy", "1 if the replica can serve; engine: its vllm: series' label",
                ["replica", "engine"], **MERGE_LATEST)
KV_INDEX_BLOCKS = Gauge("stagemesh:router_kv_index_blocks", "KV blocks the replica's events say it caches "
                        "(--policy kv-aware)", ["replica"], **MERGE_LATEST)
KV_INDEX_DEGRADED = Gauge("stagemesh:router_kv_index_degraded", "1 while the router is unsure of the replica's KV "
                          "blocks (its event stream is down, a gap was seen, a resync is under way): kv-aware routing "
                          "counts no hit there", ["replica"], **R)
KV_INDEX_RESYNCS = Counter("stagemesh:router_kv_index_resyncs", "Times the router subscribed again to a replica's KV "
                           "events because it could not trust its index of it, by reason (gap, epoch, overflow, "
                           "malformed, stream_lost, stream_ended)", ["replica", "reason"], **R)
ROUTER_RUNNING = Gauge("stagemesh:router_replica_num_requests_running", "The replica's running requests",
                       ["replica"], **MERGE_LATEST)
ROUTER_WAITING = Gauge("stagemesh:router_replica_num_requests_waiting", "The replica's waiting requests",
                       ["replica"], **MERGE_LATEST)
IN_FLIGHT = Gauge("stagemesh:router_requests_in_flight", "Requests the routers are serving now", **MERGE_SUM)
