"""What the router tells the outside about its requests and replicas: the metrics (router.metrics) and
a log line per request."""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, TypedDict

from opentelemetry import trace
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from router import metrics as m

log = logging.getLogger("stagemesh.router")


class _State(TypedDict):
    name: str  # the served model's
    engines: dict[str, str]  # replica address -> its engine label
    tokens: m.TokenHistograms | None  # once configured
    page: Any  # the registry /metrics shows, once made (page_registry)


_state: _State = {"name": "", "engines": {}, "tokens": None, "page": None}
_counted: dict[str, tuple[int, ...]] = {}  # replica -> its counters seen so far (prefix, preemptions, spec)


def configure(model_name: str, max_model_len: int) -> None:
    """The served name and the context length (the token histograms' last bucket). Once per process: the
    series live in one registry. The replicas' engine labels come from add_replica."""
    _state["name"] = model_name
    if _state["tokens"] is None:
        _state["tokens"] = m.TokenHistograms(max_model_len)


def add_replica(address: str) -> str:
    """A replica's `engine` label: the next index for an address not seen before (the router's --replica order,
    then replicas added while it runs); one an address had stays its own."""
    engines = _state["engines"]
    return engines.setdefault(address, str(len(engines)))


def forget_replica(address: str) -> None:
    """A replica the router no longer balances over: its router series go (its vllm: counters stay). Shared
    between routers (router.metrics) a series cannot be removed: they go to 0 instead."""
    engine = _state["engines"].get(address)
    for gauge, labels in ((m.HEALTHY, (address, engine)), (m.ROUTER_RUNNING, (address,)),
                          (m.ROUTER_WAITING, (address,)), (m.KV_INDEX_BLOCKS, (address,)),
                          (m.KV_INDEX_DEGRADED, (address,))):
        if m.MULTIPROC_DIR:
            if None not in labels:
                gauge.labels(*labels).set(0)
            continue
        try:
            gauge.remove(*labels)
        except KeyError:  # (never set)
            pass


def _labels(address: str | None) -> tuple[str, str]:
    return _state["name"], _state["engines"].get(address or "", "0")


def replica_state(address: str, healthy: bool, stats=None) -> None:
    """A replica's health and, when given, its scheduler's stats (a Stats message)."""
    m.HEALTHY.labels(address, add_replica(address)).set(1 if healthy else 0)
    if stats is None or not _state["name"]:  # before the router knows the model's name
        return
    labels = _labels(address)
    m.ROUTER_RUNNING.labels(address).set(stats.num_running)
    m.ROUTER_WAITING.labels(address).set(stats.num_waiting)
    m.RUNNING.labels(*labels).set(stats.num_running)
    m.WAITING.labels(*labels).set(stats.num_waiting)
    m.KV_USAGE.labels(*labels).set(stats.kv_cache_usage)
    if stats.max_loras:
        m.LoRAInfo.get().set(tuple(labels), stats.max_loras, list(stats.waiting_lora_adapters),
                             list(stats.running_lora_adapters))
    # speculative decoding's counters exist where a replica speculates (it reports one count per position)
    per_pos = list(stats.spec_decode_num_accepted_tokens_per_pos)
    spec = (stats.spec_decode_num_drafts, stats.spec_decode_num_draft_tokens,
            stats.spec_decode_num_accepted_tokens) if per_pos else ()
    now = (stats.prefix_cache_queries, stats.prefix_cache_hits, stats.num_preemptions, *spec, *per_pos)
    before = _counted.get(address, ())
    if len(before) != len(now) or any(n < b for n, b in zip(now, before)):  # the scheduler's counts restarted
        before = (0,) * len(now)  # (a new epoch, a restart)
    counters = [c.labels(*labels) for c in (m.PREFIX_QUERIES, m.PREFIX_HITS, m.PREEMPTIONS)]
    if per_pos:  # (the families are declared with the first replica that speculates)
        spec_counters = m.SpecDecodeCounters.get()
        counters += [c.labels(*labels) for c in (spec_counters.drafts, spec_counters.draft_tokens,
                                                  spec_counters.accepted)]
        counters += [spec_counters.accepted_per_pos.labels(*labels, str(pos)) for pos in range(len(per_pos))]
    for counter, n, b in zip(counters, now, before):
        counter.inc(max(n - b, 0))  # (a zero creates the series: a dashboard sees 0)
    _counted[address] = now


def kv_index_state(address: str, degraded: bool, num_blocks: int) -> None:
    """The router's KV index of a replica: whether it is unsure of it, and the blocks it believes it holds."""
    m.KV_INDEX_DEGRADED.labels(address).set(1 if degraded else 0)
    m.KV_INDEX_BLOCKS.labels(address).set(num_blocks)


def kv_index_resync(address: str, reason: str) -> None:
    m.KV_INDEX_RESYNCS.labels(address, reason).inc()


def page_registry():
    """What /metrics shows: this router's registry, or with routers that share their series (router.metrics) every
    router's, merged."""
    if not m.MULTIPROC_DIR:
        return m.REGISTRY
    if _state["page"] is None:
        from router.metrics_shared import shared_registry

        _state["page"] = shared_registry(m.MULTIPROC_DIR)
    return _state["page"]


async def metrics_handler(request):
    from aiohttp import web

    # (the merge reads every router's files: off the event loop)
    body = await asyncio.to_thread(generate_latest, page_registry())
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


def migrated(how: str) -> None:
    """A request a draining replica handed on goes on elsewhere: "kv" (with its KV) or "recompute"."""
    m.MIGRATED.labels(how).inc()


def tenant_refused(tenant: str, code: int, reason: str) -> None:
    """A request of the tenant refused by its limits (429) or shed (503); reason: the limit or bound."""
    m.TENANT_REFUSED.labels(tenant or "none", str(code), reason).inc()


def group_done(n: int, max_generated: int, replica: str | None) -> None:
    """A prompt's n choices have all finished: vLLM's per-request n and the most tokens one of them made."""
    labels = _labels(replica)
    m.N_PARAM.labels(*labels).observe(n)
    if _state["tokens"] is not None:
        _state["tokens"].max_generation.labels(*labels).observe(max_generated)


class RequestRecord:
    """One sequence (a choice) as the router sees it: its timing; ``done`` counts it and logs it."""

    FINISHED = ("stop", "length", "abort")  # what vLLM counts as finished (not errors, not refusals)

    def __init__(self, request_id: str, num_prompt: int, max_tokens: int = 0, tenant: str = ""):
        self.request_id, self.num_prompt, self.max_tokens = request_id, num_prompt, max_tokens
        self.tenant = tenant  # ("": none; the router takes no keys)
        self.start = time.monotonic()
        self.queue_seconds = 0.0  # arrival to first scheduling, as its scheduler measured it
        self.first_token: float | None = None
        self.last_token: float | None = None
        self.replica = ""
        self.failed = ""  # the replica it last failed on
        self.finished = False
        self._itl: tuple[tuple[str, str], Any] | None = None  # the ITL histogram's child for its labels
        m.IN_FLIGHT.inc()

    def queued(self, seconds: float) -> None:
        self.queue_seconds = seconds

    def tokens(self, count: int) -> None:
        if not count:
            return
        now, labels = time.monotonic(), _labels(self.replica)
        if self.first_token is None:
            self.first_token = now
            m.ROUTER_TTFT.observe(now - self.start)
            m.TTFT.labels(*labels).observe(now - self.start)
        elif self.last_token is not None:  # tokens that arrived together share the gap since the last ones
            if self._itl is None or self._itl[0] != labels:  # (the labelled child looked up once, not a token)
                self._itl = labels, m.ITL.labels(*labels)
            itl = self._itl[1]
            for _ in range(count):
                itl.observe((now - self.last_token) / count)
        self.last_token = now

    def replayed(self, failed: str, error: str, num_generated: int) -> None:
        """The request's replica failed; it goes on elsewhere (the next replica is set when it is picked)."""
        m.REPLAYS.labels("continuation" if num_generated else "retry").inc()
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
        m.IN_FLIGHT.dec()
        total = time.monotonic() - self.start
        replica = self.replica or "none"
        m.REQUESTS.labels(replica, reason).inc()
        m.PROMPT_TOKENS.labels(replica).inc(self.num_prompt)
        m.GENERATION_TOKENS.labels(replica).inc(num_output)
        m.ROUTER_E2E.observe(total)
        m.GENERATION.labels(*_labels(self.replica)).inc(num_output)
        if self.tenant:
            m.TENANT_REQUESTS.labels(self.tenant, reason).inc()
            m.TENANT_PROMPT_TOKENS.labels(self.tenant).inc(self.num_prompt)
            m.TENANT_GENERATION_TOKENS.labels(self.tenant).inc(num_output)
            if self.first_token is not None:
                m.TENANT_QUEUE.labels(self.tenant).observe(self.queue_seconds)
        if reason in self.FINISHED:
            self._finished(num_output, reason, total)
        self._log(num_output, reason, total)

    def _finished(self, num_output: int, reason: str, total: float) -> None:
        """vLLM's series of a finished request. Its phases as the router sees them: queued (the scheduler's
        figure), prefill (to the first token, less the queue), decode (first to last token)."""
        labels = _labels(self.replica)
        m.SUCCESS.labels(*labels, reason).inc()
        m.PROMPT.labels(*labels).inc(self.num_prompt)
        m.E2E.labels(*labels).observe(total)
        tokens = _state["tokens"]
        if tokens is not None:
            tokens.prompt.labels(*labels).observe(self.num_prompt)
            tokens.generation.labels(*labels).observe(num_output)
            tokens.max_tokens.labels(*labels).observe(self.max_tokens)
        if self.first_token is None:  # it never ran: no phases to time
            return
        prefill = max(self.first_token - self.start - self.queue_seconds, 0.0)
        assert self.last_token is not None  # (set with first_token)
        decode = self.last_token - self.first_token
        m.QUEUE.labels(*labels).observe(self.queue_seconds)
        m.PREFILL.labels(*labels).observe(prefill)
        m.DECODE.labels(*labels).observe(decode)
        m.INFERENCE.labels(*labels).observe(prefill + decode)
        # vLLM's per-request TPOT: zero for a request of one token
        m.TPOT.labels(*labels).observe(decode / (num_output - 1) if num_output > 1 else 0.0)

    def _log(self, num_output: int, reason: str, total: float) -> None:
        replica = self.replica or "none"
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
