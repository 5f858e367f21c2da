"""The router's Prometheus metrics (on its HTTP port at /metrics) and its line per request.

One scrape of the gateway serves a vLLM dashboard (its metric names under `stagemesh:`): the
request series (tokens, finish reasons, TTFT, inter-token latency, end to end, queue time) as the
router sees every request, and the engine state of every replica (running / waiting requests, KV
usage, prefix cache, preemptions) from the schedulers' stats, labelled by replica. The
`stagemesh:router_*` series say what the router itself did (which replica served what).
"""
from __future__ import annotations

import logging
import time

from opentelemetry import trace
from prometheus_client import (CONTENT_TYPE_LATEST, GC_COLLECTOR, PLATFORM_COLLECTOR, PROCESS_COLLECTOR,
                               CollectorRegistry, Counter, Gauge, Histogram, generate_latest)

log = logging.getLogger("stagemesh.router")

_LATENCY = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_ITL = (0.001, 0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
M = ["model_name"]
# the router's own registry: its engine series share vLLM's names with the scheduler's, and a process that
# imports both (a test, an embedding application) must not see them collide
REGISTRY = CollectorRegistry()
for _collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
    REGISTRY.register(_collector)

# vLLM's engine series
R = dict(registry=REGISTRY)
RUNNING = Gauge("stagemesh:num_requests_running", "Requests in the running batch", [*M, "replica"], **R)
WAITING = Gauge("stagemesh:num_requests_waiting", "Requests waiting to be scheduled", [*M, "replica"], **R)
KV_USAGE = Gauge("stagemesh:kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 = 100%)", [*M, "replica"],
                 **R)
PREFIX_QUERIES = Counter("stagemesh:prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                         [*M, "replica"], **R)
PREFIX_HITS = Counter("stagemesh:prefix_cache_hits", "Prompt tokens found in the prefix cache", [*M, "replica"],
                      **R)
PREEMPTIONS = Counter("stagemesh:num_preemptions", "Requests preempted (recomputed later)", [*M, "replica"], **R)
PROMPT = Counter("stagemesh:prompt_tokens", "Prompt tokens of finished requests", M, **R)
GENERATION = Counter("stagemesh:generation_tokens", "Generated tokens", M, **R)
SUCCESS = Counter("stagemesh:request_success", "Finished requests, by finish reason", [*M, "finished_reason"], **R)
TTFT_ENGINE = Histogram("stagemesh:time_to_first_token_seconds", "Time to first token", M, buckets=_LATENCY, **R)
ITL = Histogram("stagemesh:inter_token_latency_seconds", "Time between two output tokens", M, buckets=_ITL, **R)
E2E_ENGINE = Histogram("stagemesh:e2e_request_latency_seconds", "Arrival to finish", M, buckets=_LATENCY, **R)
QUEUE = Histogram("stagemesh:request_queue_time_seconds", "Arrival at the scheduler to first scheduling", M,
                  buckets=_LATENCY, **R)

# the router's own
REQUESTS = Counter("stagemesh:router_requests", "Requests finished, by replica and finish reason",
                   ["replica", "finished_reason"], **R)
PROMPT_TOKENS = Counter("stagemesh:router_prompt_tokens", "Prompt tokens of finished requests", ["replica"], **R)
GENERATION_TOKENS = Counter("stagemesh:router_generation_tokens", "Tokens generated", ["replica"], **R)
TTFT = Histogram("stagemesh:router_time_to_first_token_seconds", "Time to first token seen by the router",
                 buckets=_LATENCY, **R)
REPLAYS = Counter("stagemesh:router_request_replays",
                  "Requests sent again after their replica failed: before their first token (a retry) or as a "
                  "continuation of the tokens already streamed", ["kind"], **R)
E2E = Histogram("stagemesh:router_e2e_request_latency_seconds", "Request latency seen by the router",
                buckets=_LATENCY, **R)
HEALTHY = Gauge("stagemesh:router_replica_healthy", "1 if the replica can serve", ["replica"], **R)
ROUTER_RUNNING = Gauge("stagemesh:router_replica_num_requests_running", "The replica's running requests",
                       ["replica"], **R)
ROUTER_WAITING = Gauge("stagemesh:router_replica_num_requests_waiting", "The replica's waiting requests",
                       ["replica"], **R)
IN_FLIGHT = Gauge("stagemesh:router_requests_in_flight", "Requests the router is serving now", **R)

_model = {"name": ""}
_counted: dict[str, tuple[int, int, int]] = {}  # replica -> prefix queries, hits, preemptions seen so far


def set_model_name(name: str) -> None:
    _model["name"] = name


def replica_state(address: str, healthy: bool, stats=None) -> None:
    """A replica's health and, when given, its scheduler's stats (a Stats message)."""
    HEALTHY.labels(address).set(1 if healthy else 0)
    name = _model["name"]
    if stats is None or not name:  # before the router knows the model's name (its first health check)
        return
    ROUTER_RUNNING.labels(address).set(stats.num_running)
    ROUTER_WAITING.labels(address).set(stats.num_waiting)
    RUNNING.labels(name, address).set(stats.num_running)
    WAITING.labels(name, address).set(stats.num_waiting)
    KV_USAGE.labels(name, address).set(stats.kv_cache_usage)
    now = (stats.prefix_cache_queries, stats.prefix_cache_hits, stats.num_preemptions)
    before = _counted.get(address, (0, 0, 0))
    if any(n < b for n, b in zip(now, before)):  # the scheduler's counts restarted (a new epoch, a restart)
        before = (0, 0, 0)
    for counter, n, b in zip((PREFIX_QUERIES, PREFIX_HITS, PREEMPTIONS), now, before):
        counter.labels(name, address).inc(max(n - b, 0))  # (a zero creates the series: a dashboard sees 0)
    _counted[address] = now


async def metrics_handler(request):
    from aiohttp import web

    return web.Response(body=generate_latest(REGISTRY), headers={"Content-Type": CONTENT_TYPE_LATEST})


class RequestRecord:
    """Timing of one request as the router sees it; ``done`` logs it and counts it."""

    def __init__(self, request_id: str, num_prompt: int):
        self.request_id, self.num_prompt = request_id, num_prompt
        self.start = time.monotonic()
        self.first_token: float | None = None
        self.last_token: float | None = None
        self.replica = ""
        self.failed = ""  # the replica it last failed on
        self.finished = False
        IN_FLIGHT.inc()

    def queued(self, seconds: float) -> None:
        QUEUE.labels(_model["name"]).observe(seconds)

    def tokens(self, count: int) -> None:
        if not count:
            return
        now, name = time.monotonic(), _model["name"]
        if self.first_token is None:
            self.first_token = now
            TTFT.observe(now - self.start)
            TTFT_ENGINE.labels(name).observe(now - self.start)
        else:  # tokens that arrived together share the gap since the last ones
            for _ in range(count):
                ITL.labels(name).observe((now - self.last_token) / count)
        self.last_token = now

    def replayed(self, failed: str, error: str, num_generated: int) -> None:
        """The request's replica failed; it goes on elsewhere (the next replica is set when it is picked)."""
        REPLAYS.labels("continuation" if num_generated else "retry").inc()
        log.warning("request %s: replica %s failed after %d token(s) (%s); continuing it on another replica",
                    self.request_id, failed, num_generated, error)
        self.failed = failed

    def resumed(self, replica: str, num_generated: int) -> None:
        span = trace.get_current_span()
        if span.is_recording():
            span.add_event("recovered", {"stagemesh.failed_replica": self.failed, "stagemesh.replica": replica,
                                         "stagemesh.generated_tokens": num_generated})

    def done(self, num_output: int, reason: str) -> None:
        """Count and log the request; later calls do nothing."""
        if self.finished:
            return
        self.finished = True
        IN_FLIGHT.dec()
        total = time.monotonic() - self.start
        replica, name = self.replica or "none", _model["name"]
        REQUESTS.labels(replica, reason).inc()
        PROMPT_TOKENS.labels(replica).inc(self.num_prompt)
        GENERATION_TOKENS.labels(replica).inc(num_output)
        E2E.observe(total)
        if reason in ("stop", "length", "abort"):  # what vLLM counts as finished
            SUCCESS.labels(name, reason).inc()
            PROMPT.labels(name).inc(self.num_prompt)
            E2E_ENGINE.labels(name).observe(total)
        GENERATION.labels(name).inc(num_output)
        ttft = self.first_token - self.start if self.first_token is not None else None
        span = trace.get_current_span()
        if span.is_recording():
            span.set_attributes({"stagemesh.request_id": self.request_id, "stagemesh.replica": replica,
                                 "gen_ai.usage.input_tokens": self.num_prompt,
                                 "gen_ai.usage.output_tokens": num_output, "stagemesh.finish_reason": reason})
        fields = {"request_id": self.request_id, "replica": replica, "prompt_tokens": self.num_prompt,
                  "output_tokens": num_output, "ttft_s": round(ttft, 4) if ttft is not None else None,
                  "total_s": round(total, 4), "finish_reason": reason}
        log.info("request %s on %s: %s, %d prompt + %d output tokens, TTFT %s, total %.3fs", self.request_id,
                 replica, reason, self.num_prompt, num_output, f"{ttft:.3f}s" if ttft is not None else "-", total,
                 extra={"fields": fields})
