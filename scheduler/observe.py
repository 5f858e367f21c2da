"""What the scheduler tells the outside: Prometheus metrics, request and step spans, request logs.

The driver calls the hooks; the core scheduler stays free of them. Metric
names follow vLLM's with a ``stagemesh:`` prefix: vLLM's own names are on the
router's page (router.metrics), so that a Prometheus scraping every service
counts no request twice under them. Each request gets a span
(child of the router's, from the gRPC metadata) with events queued /
scheduled / first_token / preempted / stalled / recovered / finished (stalled:
the pipeline broke under it and it was kept; recovered: its first token after
the pipeline re-formed, with the failure and the seconds it stalled). Each step gets a span whose
parent is the span of the first request in it and which links to the rest,
so a request's trace holds the steps that served it (OpenTelemetry's pattern
for batches).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from opentelemetry import trace
from prometheus_client import Counter, Gauge, Histogram

from scheduler.request import RequestOutput
from scheduler.speculation import SpecDecodeStats
from stagemesh.core import telemetry

log = logging.getLogger("stagemesh.scheduler")

_LATENCY = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_ITL = (0.001, 0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)

RUNNING = Gauge("stagemesh:num_requests_running", "Requests in the running batch")
WAITING = Gauge("stagemesh:num_requests_waiting", "Requests waiting to be scheduled")
KV_USAGE = Gauge("stagemesh:kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 = 100%)")
CACHE_CONFIG = Gauge("stagemesh:cache_config_info", "The formed pipeline's KV cache (vLLM's cache_config_info): 1, "
                     "with its dtype (--kv-cache-dtype), block size, blocks and bytes per token (every stage and "
                     "rank together) as labels", ["cache_dtype", "block_size", "num_gpu_blocks", "kv_bytes_per_token"])
KV_TOKENS = Gauge("stagemesh:kv_cache_size_tokens", "Tokens the KV cache holds (the minimum over the stages, as "
                  "the start-up log's KV cache size)")
PREFIX_QUERIES = Counter("stagemesh:prefix_cache_queries", "Prompt tokens looked up in the prefix cache")
PREFIX_HITS = Counter("stagemesh:prefix_cache_hits", "Prompt tokens found in the prefix cache")
PREEMPTIONS = Counter("stagemesh:num_preemptions", "Requests preempted (recomputed later)")
PROMPT_TOKENS = Counter("stagemesh:prompt_tokens", "Prompt tokens of finished requests")
GENERATION_TOKENS = Counter("stagemesh:generation_tokens", "Generated tokens")
SUCCESS = Counter("stagemesh:request_success", "Finished requests", ["finished_reason"])
TTFT = Histogram("stagemesh:time_to_first_token_seconds", "Time to first token", buckets=_LATENCY)
ITL = Histogram("stagemesh:inter_token_latency_seconds", "Time between two output tokens", buckets=_ITL)
E2E = Histogram("stagemesh:e2e_request_latency_seconds", "Arrival to finish", buckets=_LATENCY)
QUEUE = Histogram("stagemesh:request_queue_time_seconds", "Arrival to first scheduling", buckets=_LATENCY)
RECOVERED = Counter("stagemesh:num_requests_recovered",
                    "Requests kept through a broken pipeline that went on once it re-formed")
STALL = Histogram("stagemesh:request_recovery_stall_seconds",
                  "From a pipeline's failure to a kept request's next token", buckets=_LATENCY)
CONTINUED = Counter("stagemesh:num_requests_continued",
                    "Requests continued here after their replica failed (submitted with generated tokens)")
KV_PULLS = Counter("stagemesh:kv_transfer_pulls", "Prompts whose KV was fetched from a prefill replica "
                   "(outcome ok) or computed here after a failed fetch (outcome failed)", ["outcome"])
KV_PULL_TIME = Histogram("stagemesh:kv_transfer_pull_seconds", "Fetching one prompt's KV from a prefill replica",
                         buckets=_LATENCY)
KV_TIER_STORED = Counter("stagemesh:kv_tier_stored_blocks", "KV blocks copied into a KV tier (docs/kv-tiers.md)",
                         ["tier"])
KV_TIER_LOADED = Counter("stagemesh:kv_tier_loaded_blocks", "KV blocks loaded back from a KV tier instead of "
                         "computed", ["tier"])
KV_TIER_FAILED = Counter("stagemesh:kv_tier_failed_loads", "KV blocks a KV tier was to hold but that did not load "
                         "(computed instead; a missing, truncated, corrupt or foreign disk file)", ["tier"])
KV_TIER_BLOCKS = Gauge("stagemesh:kv_tier_blocks", "KV blocks a KV tier holds", ["tier"])
KV_TIER_LOAD_TIME = Histogram("stagemesh:kv_tier_load_seconds", "Loading one request's blocks from the KV tiers",
                              buckets=_ITL)
KV_TIER_STORE_TIME = Histogram("stagemesh:kv_tier_store_seconds", "One StoreKV round through every stage",
                               buckets=_ITL)
KV_BYTES = Counter("stagemesh:kv_transfer_bytes", "Bytes of prompts' KV fetched from prefill replicas")
KV_FAILURES = Counter("stagemesh:kv_transfer_failures", "Prompts whose KV could not be loaded from their prefill "
                      "replica, by reason (timeout, unreachable, refused, stale, hold_expired, not_peer, not_fit, "
                      "error)", ["reason"])
KV_RECOMPUTES = Counter("stagemesh:kv_transfer_recomputes", "Prompts computed here because their KV could not be "
                        "loaded (kv_load_failure_policy recompute)")
KV_FAILED_REQUESTS = Counter("stagemesh:kv_transfer_failed_requests", "Requests that failed because their prompt's "
                             "KV could not be loaded (kv_load_failure_policy fail)")
KV_WAIT = Histogram("stagemesh:kv_transfer_wait_seconds", "A decode request's arrival to its prompt's KV loaded, or to "
                    "the kv_load_failure_policy applied (bounded by --kv-load-timeout)", buckets=_LATENCY)
STEP = Histogram("stagemesh:scheduler_step_seconds", "One micro-batch through every stage", buckets=_ITL)
STEP_COMPUTE = Histogram("stagemesh:stage_compute_seconds", "Model time of one micro-batch, summed over stages",
                         buckets=_ITL)


class _SpecCounters:
    """Speculative decoding, vLLM's spec_decode counters under the mesh's prefix (the router exports vLLM's
    names): registered only on a scheduler run with --speculative-config (as vLLM declares them only with a
    speculative config)."""
    _made: "_SpecCounters | None" = None

    def __init__(self) -> None:
        self.drafts = Counter("stagemesh:spec_decode_num_drafts", "Steps of a request that carried draft tokens")
        self.draft_tokens = Counter("stagemesh:spec_decode_num_draft_tokens", "Draft tokens sent to be verified")
        self.accepted = Counter("stagemesh:spec_decode_num_accepted_tokens", "Draft tokens accepted")
        self.accepted_per_pos = Counter("stagemesh:spec_decode_num_accepted_tokens_per_pos",
                                        "Draft tokens accepted, by their position in the step's drafts",
                                        ["position"])

    @classmethod
    def get(cls) -> "_SpecCounters":
        if cls._made is None:
            cls._made = cls()
        return cls._made


@dataclass
class _Tracked:
    arrival: float
    num_prompt: int
    span: trace.Span | None
    traceparent: str = ""
    scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    num_output: int = 0
    num_cached: int = 0
    preemptions: int = 0
    stalled_since: float | None = None  # the pipeline broke under it; its next token recovers it
    failure: str = ""


class Observer:
    def __init__(self, replica: str = "", num_speculative_tokens: int = 0):
        """`num_speculative_tokens`: --speculative-config's (0: none): its counters are declared, at 0, from
        the start."""
        CACHE_CONFIG.clear()  # (a process's last pipeline's only)
        self.replica = replica
        self.requests: dict[str, _Tracked] = {}
        self._prefix = (0, 0)
        self._gauges: tuple | None = None  # the running, waiting and KV usage gauges as last set
        self._spec = SpecDecodeStats()  # counted so far: each step adds what its scheduler counted since
        if num_speculative_tokens:
            counters = _SpecCounters.get()
            for pos in range(num_speculative_tokens):
                counters.accepted_per_pos.labels(str(pos))

    # -- requests -------------------------------------------------------------
    def submitted(self, request_id: str, num_prompt: int, parent_ctx=None, num_generated: int = 0) -> None:
        span = None
        if telemetry.enabled():
            span = telemetry.tracer().start_span(
                "stagemesh.request", context=parent_ctx, kind=trace.SpanKind.SERVER,
                attributes={"stagemesh.request_id": request_id, "gen_ai.usage.input_tokens": num_prompt,
                            "stagemesh.replica": self.replica})
            span.add_event("queued")
            if num_generated:
                span.set_attribute("stagemesh.continued_from_tokens", num_generated)
        if num_generated:
            CONTINUED.inc()
        tracked = _Tracked(time.monotonic(), num_prompt, span)
        tracked.traceparent = telemetry.traceparent(span)
        self.requests[request_id] = tracked

    def scheduled(self, request_ids: list[str], preempted: list[str]) -> None:
        now = time.monotonic()
        if preempted:
            PREEMPTIONS.inc(len(preempted))
        for request_id in preempted:
            t = self.requests.get(request_id)
            if t is not None:
                t.preemptions += 1
                if t.span is not None:
                    t.span.add_event("preempted")
        for request_id in request_ids:
            t = self.requests.get(request_id)
            if t is not None and t.scheduled is None:
                t.scheduled = now
                QUEUE.observe(now - t.arrival)
                if t.span is not None:
                    t.span.add_event("scheduled")

    def formed(self, kv_tokens: int) -> None:
        """A pipeline formed with a KV cache of kv_tokens tokens."""
        KV_TOKENS.set(kv_tokens)

    def stalled(self, request_ids: list[str], failure: str) -> None:
        """The pipeline broke under these requests; they are kept for the next epoch."""
        now = time.monotonic()
        for request_id in request_ids:
            t = self.requests.get(request_id)
            if t is not None and t.stalled_since is None:
                t.stalled_since, t.failure = now, failure
                if t.span is not None:
                    t.span.add_event("stalled", {"stagemesh.failure": failure})

    def outputs(self, outputs: list[RequestOutput]) -> None:
        now, generated = time.monotonic(), 0
        for out in outputs:
            t = self.requests.get(out.request_id)
            if t is None:
                continue
            if out.new_token_ids and t.stalled_since is not None:
                self._recovered(out.request_id, t, now - t.stalled_since)
            if out.new_token_ids:
                generated += len(out.new_token_ids)
                t.num_output += len(out.new_token_ids)
                if t.first_token is None:
                    t.first_token, t.num_cached = now, out.num_cached_tokens
                    TTFT.observe(now - t.arrival)
                    if t.span is not None:
                        t.span.add_event("first_token")
                elif t.last_token is not None:  # (set with first_token)
                    ITL.observe(now - t.last_token)
                t.last_token = now
            if out.finished:
                self._finish(out, t, now)
        if generated:  # one update of the counter a step, not one an output (each takes its lock)
            GENERATION_TOKENS.inc(generated)

    def _recovered(self, request_id: str, t: _Tracked, stall: float) -> None:
        RECOVERED.inc()
        STALL.observe(stall)
        if t.span is not None:
            t.span.add_event("recovered", {"stagemesh.failure": t.failure, "stagemesh.stall_seconds": stall,
                                           "stagemesh.replica": self.replica})
        log.info("request %s recovered after a %.2fs stall (%s)", request_id, stall, t.failure)
        t.stalled_since = None

    def _finish(self, out: RequestOutput, t: _Tracked, now: float) -> None:
        del self.requests[out.request_id]
        reason = out.finish_reason
        PROMPT_TOKENS.inc(t.num_prompt)
        SUCCESS.labels(reason).inc()
        E2E.observe(now - t.arrival)
        ttft = (t.first_token - t.arrival) if t.first_token is not None else None
        fields = {"request_id": out.request_id, "replica": self.replica, "prompt_tokens": t.num_prompt,
                  "output_tokens": t.num_output, "cached_tokens": t.num_cached,
                  "ttft_s": round(ttft, 4) if ttft is not None else None, "total_s": round(now - t.arrival, 4),
                  "finish_reason": reason, "preemptions": t.preemptions}
        if t.span is not None:
            t.span.add_event("finished", {"finish_reason": reason})
            t.span.set_attributes({"gen_ai.usage.output_tokens": t.num_output, "stagemesh.finish_reason": reason,
                                   "stagemesh.cached_tokens": t.num_cached, "stagemesh.preemptions": t.preemptions})
            if reason == "error":
                t.span.set_status(trace.Status(trace.StatusCode.ERROR, out.error or "error"))
            t.span.end()
        log.info("request %s finished: %s, %d prompt + %d output tokens, TTFT %s, total %.3fs",
                 out.request_id, reason, t.num_prompt, t.num_output, f"{ttft:.3f}s" if ttft is not None else "-",
                 now - t.arrival, extra={"fields": fields})

    def kv_tier_stored(self, job, ok: bool, seconds: float) -> None:
        if ok:
            KV_TIER_STORED.labels("host").inc(len(job.block_ids))
            KV_TIER_STORED.labels("disk").inc(sum(job.to_disk))
        KV_TIER_STORE_TIME.observe(seconds)

    def kv_tier_loaded(self, job, flags: list[bool], seconds: float) -> None:
        for slot, ok in zip(job.host_slots, flags):
            (KV_TIER_LOADED if ok else KV_TIER_FAILED).labels("disk" if slot < 0 else "host").inc()
        KV_TIER_LOAD_TIME.observe(seconds)

    def kv_loaded(self, result, policy: str, waited: float | None) -> None:
        """A pull ended (result: scheduler.kv_transfer.PullResult) and `policy` applies if it failed; waited:
        the request's arrival to now (None: it is gone)."""
        KV_PULLS.labels("ok" if result.ok else "failed").inc()
        if result.ok:
            KV_PULL_TIME.observe(result.seconds)
            KV_BYTES.inc(result.bytes)
        else:
            self.kv_load_refused(result.reason, policy)
        if waited is not None:
            KV_WAIT.observe(waited)

    def kv_load_refused(self, reason: str, policy: str) -> None:
        """A prompt's KV could not be loaded (`reason`); `policy` applies."""
        KV_FAILURES.labels(reason).inc()
        (KV_RECOMPUTES if policy == "recompute" else KV_FAILED_REQUESTS).inc()

    def gone(self, request_id: str) -> None:
        """The caller went away without a finished output (the stream was cancelled): an abort."""
        t = self.requests.pop(request_id, None)
        if t is None:
            return
        SUCCESS.labels("abort").inc()
        log.info("request %s aborted: its caller went away after %d output tokens", request_id, t.num_output)
        if t.span is not None:
            t.span.add_event("finished", {"finish_reason": "abort"})
            t.span.end()

    # -- steps ------------------------------------------------------------------
    def start_step(self, step_id: int, request_ids: list[str], num_tokens: int):
        """A span for one micro-batch (None when tracing is off) and the request links for the stages."""
        if not telemetry.enabled():
            return None, []
        parents = [self.requests[r].traceparent for r in request_ids if r in self.requests]
        parents = [p for p in parents if p]
        if not parents:
            return None, []
        links = [link for link in map(telemetry.link_from, parents[1:]) if link is not None]
        span = telemetry.tracer().start_span(
            "stagemesh.scheduler.step", context=telemetry.context_from(parents[0]), links=links,
            attributes={"stagemesh.step_id": step_id, "stagemesh.num_sequences": len(request_ids),
                        "stagemesh.num_tokens": num_tokens})
        return span, parents

    @staticmethod
    def cache_config(cache_dtype: str, block_size: int, num_blocks: int, bytes_per_token: int) -> None:
        """A pipeline formed with this KV cache (the last one's labels alone)."""
        CACHE_CONFIG.clear()
        CACHE_CONFIG.labels(cache_dtype, str(block_size), str(num_blocks), str(bytes_per_token)).set(1)

    def end_step(self, span, seconds: float, compute_seconds: float, stats) -> None:
        STEP.observe(seconds)
        STEP_COMPUTE.observe(compute_seconds)
        if span is not None:
            span.end()
        if stats is not None:
            # a metric's update costs microseconds a step (its lock): only the figures that changed are written
            gauges = (stats.num_running, stats.num_waiting, stats.kv_cache_usage)
            if gauges != self._gauges:
                self._gauges = gauges
                RUNNING.set(stats.num_running)
                WAITING.set(stats.num_waiting)
                KV_USAGE.set(stats.kv_cache_usage)
            queries, hits = stats.prefix_cache_queries, stats.prefix_cache_hits
            if (queries, hits) != self._prefix:
                if queries < self._prefix[0]:  # a new epoch's scheduler counts from zero
                    self._prefix = (0, 0)
                PREFIX_QUERIES.inc(queries - self._prefix[0])
                PREFIX_HITS.inc(max(hits - self._prefix[1], 0))
                self._prefix = (queries, hits)
            if stats.spec_decode is not None:
                self._count_spec(stats.spec_decode)
            for tier, n in stats.tier_blocks.items():
                KV_TIER_BLOCKS.labels(tier).set(n)

    def _count_spec(self, now: SpecDecodeStats) -> None:
        before = self._spec
        if now.num_drafts < before.num_drafts:  # a new epoch's scheduler counts from zero
            before = SpecDecodeStats()
        counters = _SpecCounters.get()
        counters.drafts.inc(now.num_drafts - before.num_drafts)
        counters.draft_tokens.inc(now.num_draft_tokens - before.num_draft_tokens)
        counters.accepted.inc(now.num_accepted_tokens - before.num_accepted_tokens)
        for pos, n in enumerate(now.accepted_per_pos):
            was = before.accepted_per_pos[pos] if pos < len(before.accepted_per_pos) else 0
            counters.accepted_per_pos.labels(str(pos)).inc(n - was)
        self._spec = SpecDecodeStats(now.num_drafts, now.num_draft_tokens, now.num_accepted_tokens,
                                     list(now.accepted_per_pos))

