"""Serving throughput of `stagemesh serve` layouts on this machine, over HTTP, with `stagemesh bench`'s
client: the standard CPU workload against transformers' static batches, and tracing on against off.

    python benchmarks/bench_serving.py --layouts "" "-pp 2" --baseline          # vs transformers
    python benchmarks/bench_serving.py --layouts "-pp 2" --tracing             # 100% sampled traces vs none
    python benchmarks/bench_serving.py --layouts "-pp 2 --threads 2" --batch1  # mesh TPOT vs in-process
    python benchmarks/bench_serving.py --eight-heads --layouts "--threads 1" "-tp 2 --threads 1"  # TP scaling

Each layout is a fresh `stagemesh serve` (default model) started and stopped here; the workload is the
same seeded one for every run: 32 requests, prompts of 16-256 tokens, outputs of 16-128 (ignore_eos),
all sent at once.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import subprocess
import sys
import threading
import time
from concurrent import futures

import grpc
import requests

from stagemesh.entry.bench.backends import OpenAIBackend
from stagemesh.entry.bench.baseline import transformers_static
from stagemesh.entry.bench.cli import drive
from stagemesh.entry.bench.report import summarize
from stagemesh.entry.bench.workload import synthetic
from stagemesh.core.default_model import resolve_model
from serve_process import free_port  # noqa: E402


def otlp_sink() -> tuple[grpc.Server, int, list]:
    """An OTLP/gRPC receiver that counts the spans it gets (the traces' real destination cost)."""
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

    count = [0]
    lock = threading.Lock()

    class Sink(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request, context):
            with lock:
                count[0] += sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
            return trace_service_pb2.ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Sink(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port, count


def serve_and_bench(layout: str, workload: list, extra: list[str], max_concurrency: int | None = None,
                    model: str | None = None) -> dict:
    port = free_port()
    argv = [sys.executable, "-m", "stagemesh", "serve", *([model] if model else []), "--port", str(port),
            "--grpc-port", str(free_port()), "--log-level", "warning", *shlex.split(layout), *extra]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"`stagemesh serve {layout}` did not come up")
            try:
                if requests.get(f"http://127.0.0.1:{port}/ready", timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                pass
            time.sleep(0.5)

        async def go():
            name = requests.get(f"http://127.0.0.1:{port}/v1/models", timeout=5).json()["data"][0]["id"]
            backend = OpenAIBackend(f"http://127.0.0.1:{port}", name)
            try:
                await drive(backend, workload[:2], float("inf"), None, 0, False)  # warm up
                return await drive(backend, workload, float("inf"), max_concurrency, 0, False)
            finally:
                await backend.close()

        results, duration = asyncio.run(go())
        return summarize(results, duration)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 15)
        proc.wait(timeout=30)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layouts", nargs="+", default=["", "-pp 2"], help="`stagemesh serve` flags per layout")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--baseline", action="store_true", help="transformers' static batches of 16, same workload")
    p.add_argument("--tracing", action="store_true", help="run each layout again with every request traced")
    p.add_argument("--batch1", action="store_true", help="one request at a time: time per output token through "
                                                        "the mesh against the same model in-process")
    p.add_argument("--eight-heads", action="store_true", help="serve the SmolLM2-shaped model with 8 heads "
                                                              "(benchmarks/eight_head_model.py), which TP=2 can split")
    a = p.parse_args()
    if a.batch1:
        return batch1(a.layouts)
    from transformers import AutoTokenizer

    model = None
    if a.eight_heads:
        sys.path.insert(0, os.path.dirname(__file__))
        from eight_head_model import eight_head_model_dir

        model = str(eight_head_model_dir())
    model_dir = resolve_model(model)
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    workload = synthetic(len(tok), set(tok.all_special_ids), a.num_prompts, (16, 256), (16, 128), seed=0)
    print(f"workload: {len(workload)} requests, {sum(r.input_len for r in workload)} prompt tokens, "
          f"{sum(r.max_tokens for r in workload)} output tokens; {os.cpu_count()} cores")
    base = None
    if a.baseline:
        base = transformers_static(str(model_dir), workload, 16, progress=False)
        print(f"{base['name']}: {base['output_throughput']:.1f} output tok/s")
    for layout in a.layouts:
        off = serve_and_bench(layout, workload, [], model=model)
        line = (f"serve {layout or '(TP1 PP1 DP1)'}: {off['output_throughput']:.1f} output tok/s, "
                f"TTFT p50 {off['p50_ttft_ms']:.0f} ms, TPOT p50 {off['p50_tpot_ms']:.1f} ms, "
                f"{off['failed_requests']} failed")
        if base:
            line += f"; {off['output_throughput'] / base['output_throughput']:.2f}x transformers"
        print(line)
        if a.tracing:
            server, port, spans = otlp_sink()
            try:
                env_sampler = {"OTEL_TRACES_SAMPLER": "always_on"}
                os.environ.update(env_sampler)
                on = serve_and_bench(layout, workload, ["--otlp-traces-endpoint", f"http://127.0.0.1:{port}"],
                                     model=model)
            finally:
                server.stop(grace=2)
            print(f"serve {layout or '(TP1 PP1 DP1)'} with tracing (100% sampled, {spans[0]} spans received): "
                  f"{on['output_throughput']:.1f} output tok/s = "
                  f"{on['output_throughput'] / off['output_throughput']:.3f} of tracing off")


def batch1(layouts: list[str], tokens: int = 128) -> None:
    """TPOT of one request at a time through HTTP, router, scheduler and the stages, against the engine
    in-process (same prompt length, same number of greedy tokens, same machine, same run)."""
    sys.path.insert(0, os.path.dirname(__file__))
    from bench_decode_inprocess import bench_stagemesh

    from stagemesh.entry.local_engine import LocalEngine
    from stagemesh.core.sampling_params import SamplingParams

    model_dir = resolve_model(None)
    workload = synthetic(49152, set(), 4, (24, 24), (tokens, tokens), seed=1)
    with LocalEngine.of(model_dir) as engine:
        engine.generate([workload[0].prompt_ids], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
        inproc = 1 / bench_stagemesh(engine, workload[0].prompt_ids, tokens)
    print(f"in-process engine ({__import__('torch').get_num_threads()} threads): TPOT {inproc * 1e3:.1f} ms")
    for layout in layouts:
        mesh = serve_and_bench(layout, workload, [], max_concurrency=1)
        tpot = mesh["mean_tpot_ms"] / 1e3
        print(f"serve {layout}: TPOT {tpot * 1e3:.1f} ms (p50 {mesh['p50_tpot_ms']:.1f}), "
              f"{tpot / inproc:.3f}x in-process")


if __name__ == "__main__":
    main()
