"""The mesh tax on one host: `stagemesh serve` (router + scheduler + stage processes, over HTTP) against the
in-process engine (stagemesh.entry.local_engine: the same driver and stage code in one process, no gRPC, no HTTP),
same weights, same workload, same run.

Arms: bf16 (`--dtype bfloat16`), fp32, gguf-q4_1 (the embedded GGUF's quantised weights, `-q gguf`: fp32
activations, as the embedded model's config has it), gguf-q4_1-bf16 (the same with `--dtype bfloat16`). Each arm's
serve stays up for the whole run (idle while the in-process engine runs); each round runs, per arm, the served
workload and the in-process one in a fresh subprocess, the order of the two swapped every round, so that load
from elsewhere on a shared machine hits both. Workloads: the standard one (32 requests at once, prompts 16-256,
outputs 16-128, ignore_eos, seed 0: `stagemesh bench`'s defaults) and batch 1 (8 x 32 in / 64 out, one at a
time). Prints each round, then per arm and workload the medians and the ratio mesh / in-process (output tok/s;
TPOT at batch 1, in-process over mesh so that >= 1 is the target direction for both), with this machine's ISA.

    .venv/bin/python benchmarks/bench_mesh_tax.py [--arms bf16,gguf-q4_1] [--workloads standard,batch1] \
        [--rounds 3] [--serve-args "..."]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1]))
sys.path.insert(0, str(Path(__file__).parent))

ARMS = {"bf16": ["--dtype", "bfloat16"], "fp32": ["--dtype", "float32"], "gguf-q4_1": ["-q", "gguf"],
        "gguf-q4_1-bf16": ["-q", "gguf", "--dtype", "bfloat16"]}
WORKLOADS = {"standard": dict(num=32, input_len=(16, 256), output_len=(16, 128), concurrency=None),
             "batch1": dict(num=8, input_len=(32, 32), output_len=(64, 64), concurrency=1)}


def workload(name: str):
    from transformers import AutoTokenizer

    from stagemesh.entry.bench.workload import synthetic
    from stagemesh.core.default_model import resolve_model

    w = WORKLOADS[name]
    tok = AutoTokenizer.from_pretrained(str(resolve_model(None)))
    return synthetic(len(tok), set(tok.all_special_ids), w["num"], w["input_len"], w["output_len"], seed=0)


def engine_kwargs(arm: str) -> dict:
    from stagemesh.core.default_model import gguf_path

    kw = dict(enable_prefix_caching=False)  # as the served arm: the seeded prompts repeat between rounds
    if arm.startswith("gguf-q4_1"):
        kw.update(quantization="gguf", gguf_file=str(gguf_path()))
        return {**kw, "dtype": "bfloat16"} if arm.endswith("-bf16") else kw
    return {**kw, "dtype": {"bf16": "bfloat16", "fp32": "float32"}[arm]}


def inprocess(arm: str, name: str, model: Path | None = None) -> dict:
    """One in-process run (this process): the engine as serve's stage gets it (all the cores), warmed up; `model`:
    another model directory than the embedded model's."""
    import torch

    from stagemesh.core.default_model import resolve_model
    from stagemesh.core.engine_request import EngineRequest
    from stagemesh.core.sampling_params import SamplingParams
    from stagemesh.entry.local_engine import LocalEngine

    requests = workload(name)
    engine = LocalEngine.of(model or resolve_model(None), **engine_kwargs(arm))
    try:
        engine.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
        loop, driver = engine._loop, engine.driver
        ttfts, tpots, out_tokens = [], [], 0

        async def one(i: int, req) -> None:
            nonlocal out_tokens
            start, first, n = time.perf_counter(), None, 0
            async for out in driver.submit(EngineRequest(f"r{i}", req.prompt_ids, SamplingParams(
                    max_tokens=req.max_tokens, ignore_eos=True, temperature=0.0))):
                if out.finish_reason == "error":
                    raise RuntimeError(out.error)
                if out.new_token_ids and first is None:
                    first = time.perf_counter()
                n += len(out.new_token_ids)
            end = time.perf_counter()
            out_tokens += n
            ttfts.append(first - start)
            if n > 1:
                tpots.append((end - first) / (n - 1))

        async def run_all() -> float:
            limit = WORKLOADS[name]["concurrency"]
            start = time.perf_counter()
            if limit == 1:
                for i, req in enumerate(requests):
                    await one(i, req)
            else:
                await asyncio.gather(*(one(i, r) for i, r in enumerate(requests)))
            return time.perf_counter() - start

        duration = loop.run_until_complete(run_all())
    finally:
        engine.close()
    return {"output_throughput": out_tokens / duration, "mean_tpot_ms": 1000 * statistics.mean(tpots),
            "mean_ttft_ms": 1000 * statistics.mean(ttfts), "threads": torch.get_num_threads()}


def served(base: str, name: str) -> dict:
    """The same workload through the router's HTTP gateway, with stagemesh bench's client."""
    from stagemesh.entry.bench.backends import OpenAIBackend
    from stagemesh.entry.bench.cli import drive
    from stagemesh.entry.bench.report import summarize

    requests = workload(name)

    async def go():
        backend = OpenAIBackend(base, "", timeout_s=600)
        backend.model = (await (await backend.session.get(f"{base}/v1/models")).json())["data"][0]["id"]
        try:
            return await drive(backend, requests, float("inf"), WORKLOADS[name]["concurrency"], 0, False)
        finally:
            await backend.close()

    results, duration = asyncio.run(go())
    s = summarize(results, duration)
    if s["failed_requests"]:
        sys.exit(f"served run failed: {s.get('errors')}")
    return {k: s[k] for k in ("output_throughput", "mean_tpot_ms", "mean_ttft_ms", "total_output_tokens",
                              "duration_s")}


def isa() -> str:
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return "unknown"
    wanted = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16")
    have = [f for f in wanted if f" {f}" in flags]
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), "?")
    return f"{model}, {os.cpu_count()} CPUs, {' '.join(have)}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arms", default="bf16,gguf-q4_1")
    p.add_argument("--workloads", default="standard,batch1")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--serve-args", default="", help="more flags for every arm's serve")
    p.add_argument("--inprocess", nargs=2, metavar=("ARM", "WORKLOAD"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.inprocess:
        print(json.dumps(inprocess(*args.inprocess)))
        return
    from serve_process import start_serve, stop

    arms, names = args.arms.split(","), args.workloads.split(",")
    for a in arms:
        if a not in ARMS:
            sys.exit(f"unknown arm {a!r} (one of {', '.join(ARMS)})")
    logs = Path(tempfile.mkdtemp(prefix="stagemesh-mesh-tax-"))
    print(f"machine: {isa()}; serve logs in {logs}", flush=True)
    servers = {}
    try:
        for a in arms:
            servers[a] = start_serve(["--no-enable-prefix-caching", *ARMS[a], *args.serve_args.split()],
                                     log=logs / f"serve-{a}.log")
            print(f"{a}: serving at {servers[a][1]}", flush=True)
        figures: dict = {}
        for rnd in range(args.rounds):
            for a in arms:
                for name in names:
                    order = ("mesh", "in-process") if (rnd + arms.index(a)) % 2 == 0 else ("in-process", "mesh")
                    for side in order:
                        if side == "mesh":
                            fig = served(servers[a][1], name)
                        else:
                            out = subprocess.run([sys.executable, __file__, "--inprocess", a, name],
                                                 capture_output=True, text=True, timeout=900)
                            if out.returncode:
                                sys.exit(f"in-process {a} {name} failed:\n{out.stderr[-3000:]}")
                            fig = json.loads(out.stdout.strip().splitlines()[-1])
                        figures.setdefault((a, name, side), []).append(fig)
                        print(f"round {rnd + 1} {a:10} {name:8} {side:10} {fig['output_throughput']:7.1f} tok/s  "
                              f"TPOT {fig['mean_tpot_ms']:6.2f} ms  TTFT {fig['mean_ttft_ms']:7.1f} ms", flush=True)
    finally:
        for proc, _ in servers.values():
            stop(proc)
    print(f"\nmachine: {isa()}; medians of {args.rounds} rounds\n")
    print("| arm | workload | mesh tok/s | in-process tok/s | mesh / in-process | mesh TPOT ms | in-process TPOT ms "
          "| TPOT in-process / mesh |")
    print("|---|---|---|---|---|---|---|---|")
    for a in arms:
        for name in names:
            m = {side: {k: statistics.median(f[k] for f in figures[a, name, side])
                        for k in ("output_throughput", "mean_tpot_ms")} for side in ("mesh", "in-process")}
            print(f"| {a} | {name} | {m['mesh']['output_throughput']:.1f} | {m['in-process']['output_throughput']:.1f} "
                  f"| **{m['mesh']['output_throughput'] / m['in-process']['output_throughput']:.2f}** "
                  f"| {m['mesh']['mean_tpot_ms']:.2f} | {m['in-process']['mean_tpot_ms']:.2f} "
                  f"| {m['in-process']['mean_tpot_ms'] / m['mesh']['mean_tpot_ms']:.2f} |")


if __name__ == "__main__":
    main()
