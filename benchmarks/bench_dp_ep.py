"""Data-parallel attention with the experts spread over the replicas (`-dp 2 --enable-expert-parallel`)
against plain data parallelism (`-dp 2`, every replica holding every expert), through the real services.

Two replicas of one CPU stage each (a scheduler and a stage per replica, 1 torch thread per stage), the
random Mixtral-shaped checkpoint of benchmarks/bench_moe.py, greedy decode with ignore_eos, requests sent
straight to the schedulers over SubmitStream (the router's client). Two workloads per round, the layouts
alternating round by round so that load from elsewhere hits both:
  - both busy: --requests requests split evenly over the two replicas;
  - one busy: --requests / 2 requests on replica 0 only (with EP, replica 1's stage runs dummy forwards:
    the cost of stepping together).
Prints output tokens/s per layout and workload (median of the rounds), the ratio EP / plain, and each
stage's expert weight bytes (EP holds half).

    .venv/bin/python benchmarks/bench_dp_ep.py [--requests 16 --prompt-len 32 --max-tokens 32 --rounds 3]
        [--hidden 1024 --moe-intermediate 2048 --layers 4]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(__file__))

import grpc  # noqa: E402
from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402

from bench_moe import moe_model_dir  # noqa: E402
from router.submit_stream import SubmitStream  # noqa: E402
from stagemesh.core.engine_request import EngineRequest  # noqa: E402
from stagemesh.core.sampling_params import SamplingParams  # noqa: E402
from stagemesh.v1 import scheduler_pb2_grpc  # noqa: E402
from serve_process import free_port  # noqa: E402


class Replicas:
    """Two schedulers and their one-stage pipelines as processes; `ep`: the stages form one EP group."""

    def __init__(self, model: Path, ep: bool, layers: int, log_dir: Path):
        self.procs: list[subprocess.Popen] = []
        self.addresses = []
        env = {**os.environ, "OMP_NUM_THREADS": "1", "STAGEMESH_INTERNAL_TOKEN": ""}
        store = free_port()
        for r in range(2):
            port = free_port()
            self.addresses.append(f"127.0.0.1:{port}")
            log = open(log_dir / f"{'ep' if ep else 'plain'}-{r}.log", "ab")
            flags = (["--enable-expert-parallel", "--data-parallel-size", "2", "--data-parallel-rank", str(r),
                      "--data-parallel-rpc-port", str(store)] if ep else [])
            for argv in (["scheduler", str(model), "--port", str(port), "--no-enable-prefix-caching"],
                         ["stage", str(model), "--scheduler", self.addresses[-1], "--stage-index", "0",
                          "--layers", f"0:{layers}", "--threads", "1", *flags]):
                self.procs.append(subprocess.Popen([sys.executable, "-m", "stagemesh", *argv], stdout=log,
                                                   stderr=subprocess.STDOUT, env=env))

    def wait_healthy(self, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        for address in self.addresses:
            with grpc.insecure_channel(address) as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                while True:
                    if any(p.poll() is not None for p in self.procs) or time.monotonic() > deadline:
                        raise RuntimeError("the replicas did not come up (logs in the log directory)")
                    try:
                        if stub.Check(health_pb2.HealthCheckRequest(), timeout=2).status == 1:
                            break
                    except grpc.RpcError:
                        pass
                    time.sleep(0.3)

    def close(self) -> None:
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


async def run_workload(addresses: list[str], jobs: list[tuple[int, list[int]]], max_tokens: int) -> float:
    """Output tokens per second of `jobs` (replica index, prompt), all sent at once."""
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    channels = [grpc.aio.insecure_channel(a) for a in addresses]
    streams = [SubmitStream(scheduler_pb2_grpc.SchedulerStub(c), a) for c, a in zip(channels, addresses)]

    async def one(i: int, replica: int, prompt: list[int]) -> int:
        n = 0
        async for out in streams[replica].submit(EngineRequest(f"r{i}-{time.monotonic_ns()}", prompt, sampling)):
            n += len(out.token_ids)
        return n

    try:
        start = time.perf_counter()
        tokens = await asyncio.gather(*(one(i, r, p) for i, (r, p) in enumerate(jobs)))
        return sum(tokens) / (time.perf_counter() - start)
    finally:
        for s in streams:
            s.close()
        for c in channels:
            await c.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--moe-intermediate", type=int, default=2048)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    model = moe_model_dir(a)
    expert_bytes = a.layers * a.experts * 3 * a.hidden * a.moe_intermediate * 4
    prompts = [[(7 * i + j) % 4000 + 10 for j in range(a.prompt_len)] for i in range(a.requests)]
    workloads = {"both busy": [(i % 2, pr) for i, pr in enumerate(prompts)],
                 "one busy": [(0, pr) for pr in prompts[:a.requests // 2]]}
    results: dict[tuple[str, str], list[float]] = {}
    print(f"model {model.name}; {a.requests} requests of {a.prompt_len} prompt tokens, {a.max_tokens} output tokens "
          f"(one busy: {a.requests // 2} on replica 0); {os.cpu_count()} cores; {a.rounds} rounds")
    with tempfile.TemporaryDirectory() as logs:
        for rnd in range(a.rounds):
            for ep in ((True, False) if rnd % 2 == 0 else (False, True)):
                layout = "dp2-ep2" if ep else "dp2"
                replicas = Replicas(model, ep, a.layers, Path(logs))
                try:
                    replicas.wait_healthy()
                    asyncio.run(run_workload(replicas.addresses, workloads["both busy"][:2], 4))  # warm up
                    for name, jobs in workloads.items():
                        tps = asyncio.run(run_workload(replicas.addresses, jobs, a.max_tokens))
                        results.setdefault((layout, name), []).append(tps)
                        print(f"  round {rnd}: {layout} {name}: {tps:.1f} output tok/s", flush=True)
                finally:
                    replicas.close()
    for name in workloads:
        ep, plain = (statistics.median(results[layout, name]) for layout in ("dp2-ep2", "dp2"))
        print(f"{name}: dp2-ep2 {ep:.1f} tok/s, dp2 {plain:.1f} tok/s: EP / plain = {ep / plain:.2f}x")
    print(f"expert weights per stage: dp2-ep2 {expert_bytes / 2 / 2**20:.0f} MiB, dp2 {expert_bytes / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
