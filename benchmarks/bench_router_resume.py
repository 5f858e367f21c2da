"""What a router's death costs a stream: `stagemesh serve --api-server-count 2` on the embedded model, N
streaming clients that resume as any SSE client can (Last-Event-ID, the same X-Request-Id, on the same port,
where the kernel now hands the connection to the surviving router); one router is SIGKILLed mid-stream.

Prints, per round: the streams cut and resumed, the resume gap (from the kill to each cut stream's next token:
p50 / max), the inter-token latency before the kill (p50 / p99) for scale, and whether every stream's text
equals an undisturbed run's (greedy).

    .venv/bin/python benchmarks/bench_router_resume.py [--streams 16 --max-tokens 96 --rounds 2]
"""
from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from serve_process import start_serve, stop  # noqa: E402
from sse_client import stream  # noqa: E402


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(int(q * len(values)), len(values) - 1)] if values else float("nan")


def run_round(base: str, log: Path, args, prompts: list[str], want: list[str], round_no: int) -> dict:
    times: dict[int, list[float]] = {i: [] for i in range(args.streams)}
    lock = threading.Lock()

    def one(i: int):
        def seen(out):
            with lock:
                times[i].append(time.monotonic())
        body = {"model": args.model_name, "prompt": prompts[i], "max_tokens": args.max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True}
        return stream([base], "/v1/completions", body, f"bench-{round_no}-{i}", on_event=seen, timeout=600)

    routers = [int(p) for p in re.findall(r"started router\[\d\] \(pid (\d+)\)", log.read_text())]
    with ThreadPoolExecutor(args.streams) as pool:
        futures = [pool.submit(one, i) for i in range(args.streams)]
        while min(len(t) for t in times.values()) < args.max_tokens // 4:
            time.sleep(0.005)
        victim = routers[-1]
        killed_at = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        results = [f.result() for f in futures]
    gaps, itl = [], []
    for i, got in enumerate(results):
        before = [t for t in times[i] if t < killed_at]
        itl += [b - a for a, b in zip(before, before[1:])]
        if got.resumes:
            after = [t for t in times[i] if t >= killed_at]
            gaps.append(after[0] - killed_at)
    return {"resumed": sum(1 for r in results if r.resumes), "gaps": gaps, "itl": itl,
            "exact": all(r.text == w for r, w in zip(results, want))}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--model-name", default="smollm2")
    args = p.parse_args()
    from stage_worker.cpu_isa import cpu_flags, describe_isa

    print(f"{args.streams} streams x {args.max_tokens} tokens, {args.rounds} round(s); {describe_isa(cpu_flags())}")
    log = Path(tempfile.mkdtemp(prefix="stagemesh-resume-")) / "serve.log"
    proc, base = start_serve(["--api-server-count", "2", "--served-model-name", args.model_name], log)
    try:
        prompts = [f"Write a short story about the number {i}." for i in range(args.streams)]
        with ThreadPoolExecutor(args.streams) as pool:
            want = [r.text for r in pool.map(lambda i: stream([base], "/v1/completions", {
                "model": args.model_name, "prompt": prompts[i], "max_tokens": args.max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True}, f"undisturbed-{i}"), range(args.streams))]
        for r in range(args.rounds):
            time.sleep(3)  # serve restarts the killed router
            out = run_round(base, log, args, prompts, want, r)
            gaps = out["gaps"] or [float("nan")]
            print(f"round {r}: {out['resumed']}/{args.streams} streams cut and resumed; resume gap p50 "
                  f"{statistics.median(gaps) * 1000:.0f} ms, max {max(gaps) * 1000:.0f} ms; ITL "
                  f"before the kill p50 {pct(out['itl'], 0.5) * 1000:.1f} ms, p99 {pct(out['itl'], 0.99) * 1000:.1f}"
                  f" ms; every text equals the undisturbed run's: {out['exact']}")
    finally:
        stop(proc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
