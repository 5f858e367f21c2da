"""OpenTelemetry tracing for every service.

Configured by ``--otlp-traces-endpoint`` (vLLM's flag) or the standard
variables: OTEL_EXPORTER_OTLP_TRACES_ENDPOINT / OTEL_EXPORTER_OTLP_ENDPOINT,
OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL (``grpc``, the default, or
``http/protobuf``), OTEL_TRACES_SAMPLER[_ARG] and OTEL_SERVICE_NAME. With no
endpoint, tracing is off: :func:`enabled` is False and the callers skip every
span, so it costs one boolean test per step.

W3C trace context crosses processes as gRPC metadata (:func:`inject` /
:func:`extract`) and, for the spans of a batch, as traceparent strings in the
step messages (:func:`traceparent` / :func:`link_from`).
"""
from __future__ import annotations

import atexit
import logging
import os

from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.trace import Link, SpanContext, TraceFlags

log = logging.getLogger("stagemesh.telemetry")

_enabled = False
_tracer: trace.Tracer = trace.NoOpTracer()


def enabled() -> bool:
    return _enabled


def tracer() -> trace.Tracer:
    return _tracer


def _env(name: str) -> str | None:
    return os.environ.get(f"OTEL_EXPORTER_OTLP_TRACES_{name}") or os.environ.get(f"OTEL_EXPORTER_OTLP_{name}")


def setup_tracing(service_name: str, endpoint: str | None = None) -> bool:
    """Install a tracer provider that exports to OTLP; returns whether tracing is on."""
    global _enabled, _tracer
    endpoint = endpoint or _env("ENDPOINT")
    if not endpoint:
        return False
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    from opentelemetry.sdk.trace.export import SpanExporter

    protocol = (_env("PROTOCOL") or "grpc").strip().lower()
    exporter: SpanExporter
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        insecure = not endpoint.startswith("https://")
        exporter = OTLPSpanExporter(endpoint=endpoint, insecure=insecure)
    elif protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HTTPSpanExporter

        if not endpoint.rstrip("/").endswith("/v1/traces"):
            endpoint = endpoint.rstrip("/") + "/v1/traces"
        exporter = HTTPSpanExporter(endpoint=endpoint)
    else:
        from stagemesh.core.errors import StagemeshError

        raise StagemeshError(f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol!r}: stagemesh exports 'grpc' or 'http/protobuf'")
    # OTEL_SERVICE_NAME (read by Resource.create) overrides the service's own name
    resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME") or service_name})
    provider = TracerProvider(resource=resource)  # the sampler comes from OTEL_TRACES_SAMPLER
    provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=500))
    trace.set_tracer_provider(provider)
    atexit.register(provider.shutdown)
    _tracer = provider.get_tracer("stagemesh")
    _enabled = True
    log.info("tracing to %s over %s as %s", endpoint, protocol, resource.attributes.get("service.name"))
    return True


def flush() -> None:
    provider = trace.get_tracer_provider()
    if hasattr(provider, "force_flush"):
        provider.force_flush(5000)


def inject(context=None) -> list[tuple[str, str]]:
    """The current (or given) context as gRPC metadata pairs; empty when tracing is off."""
    if not _enabled:
        return []
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=context)
    return list(carrier.items())


def extract(metadata) -> Context | None:
    """A context from gRPC invocation metadata (None when there is none)."""
    if not _enabled or not metadata:
        return None
    carrier = {item[0]: item[1] for item in metadata if isinstance(item[1], str)}
    return propagate.extract(carrier) if "traceparent" in carrier else None


def traceparent(span: trace.Span | None) -> str:
    """A span's W3C traceparent string ('' for none or a non-recording span)."""
    if span is None:
        return ""
    ctx = span.get_span_context()
    if not ctx.is_valid:
        return ""
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


def span_context_from(text: str) -> SpanContext | None:
    try:
        version, trace_id, span_id, flags = text.split("-")
        return SpanContext(int(trace_id, 16), int(span_id, 16), is_remote=True, trace_flags=TraceFlags(int(flags, 16)))
    except (ValueError, AttributeError):
        return None


def link_from(text: str) -> Link | None:
    ctx = span_context_from(text) if text else None
    return Link(ctx) if ctx is not None else None


def context_from(text: str):
    """A context whose parent is the span named by a traceparent string."""
    ctx = span_context_from(text) if text else None
    if ctx is None:
        return None
    return trace.set_span_in_context(trace.NonRecordingSpan(ctx))
