"""Traces, metrics and logs of a real PP=2 mesh: a real OTLP receiver, real /metrics scrapes."""
from __future__ import annotations

import json
import re
import threading
from concurrent import futures
from pathlib import Path

import grpc
import pytest
import requests
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from mesh import Mesh, Router, free_port
from tiny_models import with_word_tokenizer

pytestmark = pytest.mark.slow


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace receiver on loopback: keeps every span it is sent."""

    def __init__(self):
        self.spans: list[tuple[str, object]] = []  # (service.name, Span)
        self.lock = threading.Lock()
        self.server = grpc.server(futures.ThreadPoolExecutor(4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")

    def Export(self, request, context):
        with self.lock:
            for rs in request.resource_spans:
                service = next((a.value.string_value for a in rs.resource.attributes if a.key == "service.name"), "")
                for ss in rs.scope_spans:
                    self.spans.extend((service, span) for span in ss.spans)
        return trace_service_pb2.ExportTraceServiceResponse()


@pytest.fixture(scope="module")
def receiver():
    r = Receiver()
    r.server.start()
    yield r
    r.server.stop(grace=None)


@pytest.fixture(scope="module")
def mesh(tiny_model_dir, tmp_path_factory, receiver):
    logs = tmp_path_factory.mktemp("observability")
    model = with_word_tokenizer(tiny_model_dir("llama"), logs / "model")
    endpoint = f"http://127.0.0.1:{receiver.port}"
    sched_metrics, stage_metrics = free_port(), [free_port(), free_port()]
    with Mesh(model, [2, 2], handoff="grpc", log_dir=logs,
              scheduler_args=("--served-model-name", "m", "--otlp-traces-endpoint", endpoint,
                              "--metrics-port", str(sched_metrics), "--log-format", "json"),
              stage_args=("--otlp-traces-endpoint", endpoint),
              per_stage_args={i: ["--metrics-port", str(p)] for i, p in enumerate(stage_metrics)}) as m:
        with Router(model, [m.address], log_dir=logs, extra=("--otlp-traces-endpoint", endpoint)) as router:
            m.router, m.logs, m.model = router, logs, model
            m.metrics = {"scheduler": sched_metrics, "stage0": stage_metrics[0], "stage1": stage_metrics[1]}
            yield m


def scrape(url: str) -> dict[str, float]:
    """name{labels} -> value of a Prometheus text page."""
    out = {}
    for line in requests.get(url, timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


def _text(base_url: str) -> str:
    return requests.get(f"{base_url}/metrics", timeout=10).text


def series(text: str) -> list[tuple[str, dict, float]]:
    """(name, labels, value) of every sample of a Prometheus text page."""
    from prometheus_client.parser import text_string_to_metric_families

    return [(s.name, s.labels, s.value) for f in text_string_to_metric_families(text) for s in f.samples]


def _value(samples, name: str, labels: dict) -> float:
    return sum(v for n, ls, v in samples if n == name and labels.items() <= ls.items())


def test_one_chat_request_is_one_trace_through_every_service(mesh, receiver):
    client = mesh.router.client()
    out = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "a b c"}], max_tokens=5,
                                         temperature=0, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 5
    services = {"stagemesh-router", "stagemesh-scheduler", "stagemesh-stage-0", "stagemesh-stage-1"}
    trace_id = _wait_for_trace(receiver, services)
    spans = [(svc, s) for svc, s in receiver.spans if s.trace_id == trace_id]
    names = {(svc, s.name) for svc, s in spans}
    assert ("stagemesh-scheduler", "stagemesh.request") in names
    assert ("stagemesh-scheduler", "stagemesh.scheduler.step") in names
    request_span = next(s for svc, s in spans if s.name == "stagemesh.request")
    events = [e.name for e in request_span.events]
    assert events[:3] == ["queued", "scheduled", "first_token"] and events[-1] == "finished"
    attrs = {a.key: a.value for a in request_span.attributes}
    assert attrs["gen_ai.usage.output_tokens"].int_value == 5
    # the router's HTTP span is the request span's parent: one trace, one tree
    router_ids = {s.span_id for svc, s in spans if svc == "stagemesh-router"}
    assert request_span.parent_span_id in router_ids
    # every stage ran a forward span per step: 5 tokens need at least 5 steps through each stage
    for index in (0, 1):
        forwards = [s for svc, s in spans if svc == f"stagemesh-stage-{index}" and s.name == "stagemesh.stage.forward"]
        assert len(forwards) >= 5
        a = {x.key: x.value for x in forwards[0].attributes}
        assert a["stagemesh.stage.index"].int_value == index
        assert (a["stagemesh.stage.layer_start"].int_value, a["stagemesh.stage.layer_end"].int_value) == \
            ((0, 2) if index == 0 else (2, 4))
        assert a["stagemesh.stage.tp_size"].int_value == 1
        assert "stagemesh.handoff.wait_seconds" in a and "stagemesh.handoff.bytes" in a
    sent = [x.value.int_value for svc, s in spans if svc == "stagemesh-stage-0" for x in s.attributes
            if x.key == "stagemesh.handoff.bytes"]
    assert sent and all(b > 0 for b in sent)  # stage 0 hands activations to stage 1 over gRPC


def _wait_for_trace(receiver: Receiver, services: set[str], timeout: float = 30) -> bytes:
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with receiver.lock:
            by_trace: dict[bytes, set[str]] = {}
            for svc, span in receiver.spans:
                by_trace.setdefault(span.trace_id, set()).add(svc)
        found = [t for t, svcs in by_trace.items() if services <= svcs]
        if found:
            time.sleep(1.0)  # let the last batches arrive
            return found[0]
        time.sleep(0.25)
    raise AssertionError(f"no trace with spans of {sorted(services)}; got {sorted({s for s, _ in receiver.spans})}")


def test_metrics_move_by_the_right_amounts(mesh):
    base = f"http://127.0.0.1:{mesh.metrics['scheduler']}/metrics"
    before = scrape(base)
    router_before_text = _text(mesh.router.base_url)
    router_before = scrape(f"{mesh.router.base_url}/metrics")
    stage_before = [scrape(f"http://127.0.0.1:{mesh.metrics[f'stage{i}']}/metrics") for i in (0, 1)]
    client = mesh.router.client()
    prompt = "a b c d e f"
    num_prompt = len(requests.post(f"{mesh.router.base_url}/tokenize", json={"prompt": prompt}, timeout=10)
                     .json()["tokens"])
    for max_tokens in (3, 4, 6):
        client.completions.create(model="m", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                  extra_body={"ignore_eos": True})
    after = scrape(base)

    def moved(name: str, page_before=before, page_after=after) -> float:
        return page_after.get(name, 0.0) - page_before.get(name, 0.0)

    assert moved("stagemesh:generation_tokens_total") == 13
    assert moved("stagemesh:prompt_tokens_total") == 3 * num_prompt
    assert moved('stagemesh:request_success_total{finished_reason="length"}') == 3
    assert moved("stagemesh:time_to_first_token_seconds_count") == 3
    assert moved("stagemesh:e2e_request_latency_seconds_count") == 3
    assert moved("stagemesh:request_queue_time_seconds_count") == 3
    assert moved("stagemesh:inter_token_latency_seconds_count") == 13 - 3
    assert moved("stagemesh:prefix_cache_queries_total") == 3 * num_prompt
    assert after["stagemesh:num_requests_running"] == 0 and after["stagemesh:num_requests_waiting"] == 0
    router_after = scrape(f"{mesh.router.base_url}/metrics")
    replica = f'replica="{mesh.address}"'
    assert moved(f'stagemesh:router_requests_total{{finished_reason="length",{replica}}}',
                 router_before, router_after) == 3
    assert moved(f"stagemesh:router_generation_tokens_total{{{replica}}}", router_before, router_after) == 13
    assert router_after[f'stagemesh:router_replica_healthy{{engine="0",{replica}}}'] == 1
    # vLLM's series on the gateway (model_name "m", engine 0: the router's first replica), request by request
    gw_before, gw_after = (series(page) for page in (router_before_text, _text(mesh.router.base_url)))

    def gw(name: str, **labels) -> float:
        return _value(gw_after, name, labels) - _value(gw_before, name, labels)

    assert gw("vllm:generation_tokens_total") == 13 and gw("vllm:prompt_tokens_total") == 3 * num_prompt
    assert gw("vllm:request_success_total", finished_reason="length") == 3
    assert gw("vllm:request_prompt_tokens_count") == 3 and gw("vllm:request_prompt_tokens_sum") == 3 * num_prompt
    assert gw("vllm:request_generation_tokens_sum") == 13 and gw("vllm:request_params_max_tokens_sum") == 13
    assert gw("vllm:request_max_num_generation_tokens_sum") == 13 and gw("vllm:request_params_n_sum") == 3
    assert gw("vllm:inter_token_latency_seconds_count") == 13 - 3
    for timed in ("time_to_first_token", "e2e_request_latency", "request_queue_time", "request_prefill_time",
                  "request_decode_time", "request_inference_time", "request_time_per_output_token"):
        assert gw(f"vllm:{timed}_seconds_count") == 3, timed
    # the phases add up: queue + prefill + decode is the request's time at most
    phases = sum(gw(f"vllm:request_{p}_time_seconds_sum") for p in ("queue", "prefill", "decode"))
    assert 0 < phases <= gw("vllm:e2e_request_latency_seconds_sum")
    for i in (0, 1):
        stage_after = scrape(f"http://127.0.0.1:{mesh.metrics[f'stage{i}']}/metrics")
        steps = moved(f'stagemesh:stage_steps_total{{stage="{i}"}}', stage_before[i], stage_after)
        assert steps >= 13  # one step per token at least (a prompt may take a step of its own)
        tokens = moved(f'stagemesh:stage_tokens_total{{stage="{i}"}}', stage_before[i], stage_after)
        assert tokens == 3 * num_prompt + 13 - 3  # prompts, then every sampled token but the last is fed back
        sent = moved(f'stagemesh:stage_handoff_bytes_total{{stage="{i}"}}', stage_before[i], stage_after)
        assert (sent > 0) if i == 0 else (sent == 0)


def test_json_log_line_per_finished_request(mesh):
    client = mesh.router.client()
    out = client.completions.create(model="m", prompt="a b", max_tokens=2, temperature=0,
                                    extra_body={"ignore_eos": True})
    import time

    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        lines = [json.loads(line) for line in (mesh.logs / "scheduler.log").read_text().splitlines()
                 if line.startswith("{")]
        done = [e for e in lines if e.get("request_id") == out.id and e.get("finish_reason")]
        if done:
            break
        time.sleep(0.2)
    entry = done[0]
    assert entry["output_tokens"] == 2 and entry["finish_reason"] == "length" and entry["ttft_s"] >= 0
    assert entry["replica"].endswith(f":{mesh.port}") and entry["level"] == "info"
    assert any("KV cache size" in e["message"] for e in lines)
    assert any(re.match(r"stage 1: layers 2:4, 1 rank\(s\)", e["message"]) for e in lines)
    router_log = next(mesh.logs.glob("router-*.log")).read_text()
    assert re.search(rf"request {out.id} on {mesh.address}: length, \d+ prompt \+ 2 output tokens", router_log)


def test_every_series_of_vllms_dashboard_is_on_the_gateway(mesh):
    """vLLM's Grafana dashboard (its queries' series: tests/data/vllm_grafana_series.txt) finds every series
    it reads on the gateway's one page, for the served model, with data after a request."""
    wanted = [line for line in (Path(__file__).parent / "data" / "vllm_grafana_series.txt").read_text().splitlines()
              if line and not line.startswith("#")]
    mesh.router.client().completions.create(model="m", prompt="a b c", max_tokens=3, temperature=0,
                                            extra_body={"ignore_eos": True})
    samples = series(_text(mesh.router.base_url))
    for name in wanted:
        mine = [(ls, v) for n, ls, v in samples if n == name and ls.get("model_name") == "m"]
        assert mine, f"{name} is not on /metrics for model_name='m'"
        assert all(ls.get("engine") == "0" for ls, _ in mine), name  # vLLM's engine label: the replica's index
        if name.endswith(("_count", "_total")) and "running" not in name and "waiting" not in name:
            assert sum(v for _, v in mine) > 0, f"{name} has no data"
    # the dashboard's model_name variable lists the served model from vllm: series alone
    assert {ls.get("model_name") for n, ls, _ in samples if n.startswith("vllm:")} == {"m"}
    assert not [n for n, _, _ in samples if n.startswith("stagemesh:") and not n.startswith("stagemesh:router_")]


def test_no_speculative_decoding_series_without_it(mesh):
    """A mesh without --speculative-config declares none of the spec_decode families (vLLM declares them only
    with a speculative config): no family without samples on the gateway's page or the scheduler's (the router
    is ready: it has read the replica's statistics, which would say that it speculates)."""
    for url in (mesh.router.base_url, f"http://127.0.0.1:{mesh.metrics['scheduler']}"):
        page = _text(url)
        assert "num_requests_running" in page  # (the page is the one that would hold them)
        assert "spec_decode" not in page, [line for line in page.splitlines() if "spec_decode" in line]
