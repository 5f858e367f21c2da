"""Start-up as a vLLM script sees it (issue 58): `stagemesh serve` started --starts times per layout; each time
a vLLM-style script waits for /health to say 200 (`until curl -sf .../health; do sleep 1; done`, here polled
every 50 ms) and sends its first request at once. Prints, per start: seconds to /health 200, the first
request's status, the warm-up's own cost from serve's log, and the latencies of the first three requests
(different 200-token prompts, 16 greedy tokens each, no shared prefix): first / second is what the warm-up
leaves of a cold start (issue 58's figure before it: 1.49 s against 0.72 s, 2.07x).

    PYTHONPATH=. .venv/bin/python benchmarks/bench_startup.py [--starts 5] [--layouts default,tp2pp2]

The -tp 2 -pp 2 layout runs on an 8-head model of the default model's shape (random weights; its 9 heads rule
TP 2 out) with the default model's tokenizer.
"""
from __future__ import annotations

import argparse
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests

from bench_kv_tiers_restart import isa
from serve_process import free_port


def started(args: list[str], log: Path) -> tuple[subprocess.Popen, str, float]:
    """serve started; returns once /health says 200 (the vLLM loop), with the seconds it took."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "stagemesh", "serve", "--port", str(port), *args],
                            stdout=open(log, "wb"), stderr=subprocess.STDOUT, start_new_session=True)
    base, t0 = f"http://127.0.0.1:{port}", time.monotonic()
    while time.monotonic() - t0 < 900:
        if proc.poll() is not None:
            sys.exit(f"serve exited during start-up:\n{log.read_text()[-3000:]}")
        try:
            if requests.get(f"{base}/health", timeout=2).status_code == 200:
                return proc, base, time.monotonic() - t0
        except requests.ConnectionError:
            pass
        time.sleep(0.05)
    sys.exit("serve did not come up in 900 s")


def request(base: str, model: str, prompt: list[int]) -> tuple[int, float]:
    t = time.monotonic()
    r = requests.post(f"{base}/v1/completions", timeout=600, json={
        "model": model, "prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True})
    return r.status_code, time.monotonic() - t


def one_start(args: list[str], log: Path, seed: int) -> dict:
    proc, base, ready = started(args, log)
    try:
        model = requests.get(f"{base}/v1/models", timeout=5).json()["data"][0]["id"]
        rng = random.Random(seed)
        runs = [request(base, model, [rng.randrange(1000, 40000) for _ in range(200)]) for _ in range(3)]
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=120)
    warm = [float(s) for s in re.findall(r"warm-up: .* in ([0-9.]+)s before serving", log.read_text())]
    return {"ready": ready, "status": runs[0][0], "seconds": [s for _, s in runs], "warm_up": warm}


def layout_args(name: str) -> list[str]:
    if name == "default":
        return []
    if name == "tp2pp2":
        from eight_head_model import eight_head_model_dir

        return [str(eight_head_model_dir()), "-tp", "2", "-pp", "2"]
    sys.exit(f"unknown layout {name!r}: default or tp2pp2")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--starts", type=int, default=5)
    p.add_argument("--layouts", default="default,tp2pp2")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="stagemesh-startup-"))
    print(f"{isa()}; {args.starts} starts per layout; logs in {work}", flush=True)
    for name in args.layouts.split(","):
        serve_args, rows = layout_args(name), []
        for i in range(args.starts):
            row = one_start(serve_args, work / f"{name}-{i}.log", i)
            rows.append(row)
            s = row["seconds"]
            print(f"{name} start {i + 1}: /health 200 after {row['ready']:.1f} s, first request {row['status']}; "
                  f"warm-up {', '.join(f'{w:.2f}' for w in row['warm_up'])} s; requests {s[0]:.3f} / {s[1]:.3f} / "
                  f"{s[2]:.3f} s (first / second {s[0] / s[1]:.2f})", flush=True)
        ok = sum(r["status"] == 200 for r in rows)
        ratio = statistics.median(r["seconds"][0] / r["seconds"][1] for r in rows)
        print(f"{name}: first request 200 in {ok} of {len(rows)} starts; first / second request median {ratio:.2f}",
              flush=True)


if __name__ == "__main__":
    main()
