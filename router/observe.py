"""The router's Prometheus metrics (on its HTTP port at /metrics) and its line per request."""
from __future__ import annotations

import logging
import time

from opentelemetry import trace
from prometheus_client import CONTENT_TYPE_LATEST, Counter, Gauge, Histogram, generate_latest

log = logging.getLogger("stagemesh.router")

_LATENCY = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)

REQUESTS = Counter("stagemesh:router_requests", "Requests finished, by replica and finish reason",
                   ["replica", "finished_reason"])
PROMPT_TOKENS = Counter("stagemesh:router_prompt_tokens", "Prompt tokens of finished requests", ["replica"])
GENERATION_TOKENS = Counter("stagemesh:router_generation_tokens", "Tokens generated", ["replica"])
TTFT = Histogram("stagemesh:router_time_to_first_token_seconds", "Time to first token seen by the router",
                 buckets=_LATENCY)
E2E = Histogram("stagemesh:router_e2e_request_latency_seconds", "Request latency seen by the router",
                buckets=_LATENCY)
HEALTHY = Gauge("stagemesh:router_replica_healthy", "1 if the replica can serve", ["replica"])
RUNNING = Gauge("stagemesh:router_replica_num_requests_running", "The replica's running requests", ["replica"])
WAITING = Gauge("stagemesh:router_replica_num_requests_waiting", "The replica's waiting requests", ["replica"])
IN_FLIGHT = Gauge("stagemesh:router_requests_in_flight", "Requests the router is serving now")


def replica_state(address: str, healthy: bool, running: int, waiting: int) -> None:
    HEALTHY.labels(address).set(1 if healthy else 0)
    RUNNING.labels(address).set(running)
    WAITING.labels(address).set(waiting)


async def metrics_handler(request):
    from aiohttp import web

    return web.Response(body=generate_latest(), headers={"Content-Type": CONTENT_TYPE_LATEST})


class RequestRecord:
    """Timing of one request as the router sees it; ``done`` logs it and counts it."""

    def __init__(self, request_id: str, num_prompt: int):
        self.request_id, self.num_prompt = request_id, num_prompt
        self.start = time.monotonic()
        self.first_token: float | None = None
        self.replica = ""
        self.finished = False
        IN_FLIGHT.inc()

    def tokens(self, count: int) -> None:
        if count and self.first_token is None:
            self.first_token = time.monotonic()
            TTFT.observe(self.first_token - self.start)

    def done(self, num_output: int, reason: str) -> None:
        """Count and log the request; later calls do nothing."""
        if self.finished:
            return
        self.finished = True
        IN_FLIGHT.dec()
        total = time.monotonic() - self.start
        replica = self.replica or "none"
        REQUESTS.labels(replica, reason).inc()
        PROMPT_TOKENS.labels(replica).inc(self.num_prompt)
        GENERATION_TOKENS.labels(replica).inc(num_output)
        E2E.observe(total)
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
