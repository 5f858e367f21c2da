"""`stagemesh serve --distributed-executor-backend ray` against the default mp backend, same layout, same
machine, alternating round by round: start-up (from the command to /health 200) and the step path (time
per output token at batch 1, throughput of the standard workload). Ray only places and supervises the
services, so the step path must not be slower.

    python benchmarks/bench_ray_backend.py --rounds 3 --layout "-pp 2 --threads 1"

Starts a one-node Ray cluster of its own (`ray start --head --block` in a temporary directory, stopped at
the end) and a fresh `stagemesh serve` (default model) per round and backend.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import platform
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests

from serve_process import free_port, start_serve, stop
from stagemesh.entry.bench.backends import OpenAIBackend
from stagemesh.entry.bench.cli import drive
from stagemesh.entry.bench.report import summarize
from stagemesh.entry.bench.workload import synthetic
from stagemesh.core.default_model import resolve_model


def start_ray(cpus: int) -> tuple[subprocess.Popen, str]:
    port, temp = free_port(), tempfile.mkdtemp(prefix="smrb", dir="/tmp")
    ray = str(Path(sys.executable).parent / "ray")
    proc = subprocess.Popen([ray, "start", "--head", "--block", f"--port={port}", "--node-ip-address=127.0.0.1",
                             f"--num-cpus={cpus}", "--include-dashboard=false", "--disable-usage-stats",
                             f"--temp-dir={temp}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc, f"127.0.0.1:{port}"
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("`ray start --head` did not come up") from None
            time.sleep(0.5)


def one_run(backend: str, layout: str, ray_address: str, batch1: list, standard: list) -> dict:
    start = time.monotonic()
    proc, base = start_serve(["--log-level", "warning", "--distributed-executor-backend", backend,
                              *shlex.split(layout)], env={**os.environ, "RAY_ADDRESS": ray_address}, timeout=300)
    try:
        startup = time.monotonic() - start

        async def go():
            name = requests.get(f"{base}/v1/models", timeout=5).json()["data"][0]["id"]
            client = OpenAIBackend(base, name)
            try:
                await drive(client, standard[:2], float("inf"), None, 0, False)  # warm up
                one = summarize(*await drive(client, batch1, float("inf"), 1, 0, False))
                many = summarize(*await drive(client, standard, float("inf"), None, 0, False))
                return one, many
            finally:
                await client.close()

        one, many = asyncio.run(go())
        return {"startup_s": startup, "tpot_ms": one["mean_tpot_ms"], "throughput": many["output_throughput"],
                "failed": one["failed_requests"] + many["failed_requests"]}
    finally:
        stop(proc)


def cpu_isa() -> str:
    flags = set()
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    wanted = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8")
    return " ".join(w for w in wanted if w in flags) or platform.machine()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--layout", default="-pp 2 --threads 1", help="`stagemesh serve` flags, the same for both")
    a = p.parse_args()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(resolve_model(None)))
    special = set(tok.all_special_ids)
    batch1 = synthetic(len(tok), special, 8, (32, 32), (64, 64), seed=1)
    standard = synthetic(len(tok), special, 32, (16, 256), (16, 128), seed=0)
    cores = len(os.sched_getaffinity(0))
    print(f"{cores} cores ({cpu_isa()}); layout `{a.layout}`; batch 1: 8 requests of 32 in / 64 out one at a time; "
          f"standard: 32 requests, prompts 16-256, outputs 16-128, all at once")
    ray_proc, address = start_ray(cores)
    runs: dict[str, list[dict]] = {"mp": [], "ray": []}
    try:
        for r in range(a.rounds):
            for backend in (("mp", "ray") if r % 2 == 0 else ("ray", "mp")):
                run = one_run(backend, a.layout, address, batch1, standard)
                runs[backend].append(run)
                print(f"round {r + 1} {backend:>3}: start-up {run['startup_s']:.1f} s, TPOT {run['tpot_ms']:.1f} ms, "
                      f"{run['throughput']:.1f} tok/s, {run['failed']} failed", flush=True)
    finally:
        os.killpg(ray_proc.pid, signal.SIGTERM)
        ray_proc.wait(timeout=60)
    med = {b: {k: statistics.median(x[k] for x in rs) for k in ("startup_s", "tpot_ms", "throughput")}
           for b, rs in runs.items()}
    print(f"median mp : start-up {med['mp']['startup_s']:.1f} s, TPOT {med['mp']['tpot_ms']:.1f} ms, "
          f"{med['mp']['throughput']:.1f} tok/s")
    print(f"median ray: start-up {med['ray']['startup_s']:.1f} s, TPOT {med['ray']['tpot_ms']:.1f} ms, "
          f"{med['ray']['throughput']:.1f} tok/s")
    print(f"ray / mp: start-up {med['ray']['startup_s'] / med['mp']['startup_s']:.2f}x, "
          f"TPOT {med['ray']['tpot_ms'] / med['mp']['tpot_ms']:.2f}x, "
          f"throughput {med['ray']['throughput'] / med['mp']['throughput']:.2f}x")


if __name__ == "__main__":
    main()
