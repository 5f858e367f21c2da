"""A stage's metrics and its span per forward of a micro-batch.

The span's parent is the scheduler's step span (W3C context in the gRPC
metadata) and it links to the span of every request in the micro-batch
(``ForwardRequest.trace_links``).
"""
from __future__ import annotations

import time

from opentelemetry import trace
from prometheus_client import REGISTRY, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from stagemesh.core import telemetry
from stage_worker.moe import expert_load

_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5, 5.0, 10.0)

FORWARD = Histogram("stagemesh:stage_forward_seconds", "One micro-batch through this stage (RPC to reply)",
                    ["stage"], buckets=_SECONDS)
COMPUTE = Histogram("stagemesh:stage_compute_seconds", "Model time of one micro-batch in this stage", ["stage"],
                    buckets=_SECONDS)
HANDOFF_WAIT = Histogram("stagemesh:stage_handoff_wait_seconds", "Waiting for the previous stage's activations",
                         ["stage"], buckets=_SECONDS)
HANDOFF_BYTES = Counter("stagemesh:stage_handoff_bytes", "Activation bytes sent to the next stage", ["stage"])
TOKENS = Counter("stagemesh:stage_tokens", "Tokens through this stage", ["stage"])
STEPS = Counter("stagemesh:stage_steps", "Micro-batches through this stage", ["stage"])


class ForwardObserver:
    def __init__(self, stage_index: int, layer_start: int, layer_end: int, tp_size: int, handoff: str):
        label = str(stage_index)
        self._metrics = (FORWARD.labels(label), COMPUTE.labels(label), HANDOFF_WAIT.labels(label),
                         HANDOFF_BYTES.labels(label), TOKENS.labels(label), STEPS.labels(label))
        self._attributes: dict[str, int | str]
        self._attributes = {"stagemesh.stage.index": stage_index, "stagemesh.stage.layer_start": layer_start,
                            "stagemesh.stage.layer_end": layer_end, "stagemesh.stage.tp_size": tp_size,
                            "stagemesh.stage.handoff": handoff}

    def start(self, request, metadata):
        """(span or None, start time) for one Forward."""
        span = None
        if telemetry.enabled():
            parent = telemetry.extract(metadata)
            if parent is not None:
                links = [link for link in map(telemetry.link_from, request.trace_links) if link is not None]
                step = request.step
                span = telemetry.tracer().start_span(
                    "stagemesh.stage.forward", context=parent, links=links, kind=trace.SpanKind.SERVER,
                    attributes={**self._attributes, "stagemesh.step_id": step.step_id,
                                "stagemesh.num_sequences": len(step.chunks.seq_ids),
                                "stagemesh.num_tokens": len(step.chunks.token_ids)})
        return span, time.perf_counter()

    def end(self, span, start: float, request, reply, error: str | None = None) -> None:
        forward, compute, wait, sent, tokens, steps = self._metrics
        forward.observe(time.perf_counter() - start)
        if reply is not None:
            compute.observe(reply.compute_seconds)
            wait.observe(reply.handoff_wait_seconds)
            sent.inc(reply.handoff_bytes)
            if not request.step.warmup:
                tokens.inc(len(request.step.chunks.token_ids))
                steps.inc()
        if span is None:
            return
        if reply is not None:
            span.set_attributes({"stagemesh.handoff.bytes": reply.handoff_bytes,
                                 "stagemesh.handoff.wait_seconds": reply.handoff_wait_seconds,
                                 "stagemesh.compute_seconds": reply.compute_seconds})
        if error is not None:
            span.set_status(trace.Status(trace.StatusCode.ERROR, error))
        span.end()


class ExpertLoadCollector:
    """stagemesh:moe_expert_tokens_total{stage, layer, expert}: the tokens routed to each expert of each
    sparse layer. The forward only adds to a device tensor (stage_worker.moe); it is read when scraped."""

    def __init__(self, stage_index: int, model):
        self._stage, self._model = str(stage_index), model

    def collect(self):
        family = CounterMetricFamily("stagemesh:moe_expert_tokens", "Tokens routed to each expert of a sparse layer",
                                     labels=["stage", "layer", "expert"])
        for layer, counts in expert_load(self._model).items():
            for expert, tokens in enumerate(counts):
                family.add_metric([self._stage, str(layer), str(expert)], tokens)
        yield family
        balanced = [m for m in self._model.modules() if getattr(m, "expert_map", None) is not None]
        if balanced:  # --enable-eplb
            gauge = GaugeMetricFamily("stagemesh:eplb_balancedness", "Mean over max of the TP ranks' expert tokens "
                                      "over EPLB's last window (1: even)", labels=["stage", "layer"])
            for block in balanced:
                gauge.add_metric([self._stage, str(block.layer)], block.balancedness)
            yield gauge
            decisions = CounterMetricFamily("stagemesh:eplb_rebalances", "EPLB's rebalances of a sparse layer: its "
                                            "new placement applied, or the current one kept (the new one not "
                                            "better by stage_worker.eplb's MIN_BALANCEDNESS_GAIN)",
                                            labels=["stage", "layer", "decision"])
            for block in balanced:
                for decision, count in block.eplb_rebalances.items():
                    decisions.add_metric([self._stage, str(block.layer), decision], count)
            yield decisions


def watch_expert_load(stage_index: int, model) -> None:
    REGISTRY.register(ExpertLoadCollector(stage_index, model))
