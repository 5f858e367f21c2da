"""What a rolling restart and a scale-in cost the streams being served: `stagemesh serve` (default: `-dp 2 -pp 2
--api-server-count 2`, the default model) under a steady load of looping streams; the inter-token latency p99 and
the TTFT p99 of the steady state, then during `stagemesh rollout` (every service restarted, one at a time), then
during a scale-in (`stagemesh scale` from --data-parallel-size to one fewer), each as a ratio to the steady state,
all in the same run. The client resumes a cut stream with Last-Event-ID as any SSE client can; requests lost
(an error or a non-200 answer) are counted.

    .venv/bin/python benchmarks/bench_rollout.py [--layout "-dp 2 -pp 2 --api-server-count 2"] [--streams 8]
        [--steady 30] [--max-tokens 64] [MODEL]

A stream's gap between two tokens counts in the phase its second token arrived in; a request's TTFT in the phase
it was sent in. The longest gap (a stream that waited for a restarted stage) is printed too: p99 hides a stall
that only a few streams meet.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import tempfile
import time
import uuid
from pathlib import Path

import aiohttp
import requests

from serve_process import start_serve, stop


class Phases:
    """Named time windows (start, end) of the run, in time.perf_counter()."""

    def __init__(self) -> None:
        self.windows: dict[str, tuple[float, float]] = {}

    def of(self, t: float) -> str | None:
        return next((name for name, (a, b) in self.windows.items() if a <= t < b), None)


class Record:
    def __init__(self) -> None:
        self.ttft: list[tuple[float, float]] = []  # (sent at, TTFT)
        self.gaps: list[tuple[float, float]] = []  # (second token's arrival, gap)
        self.done = 0
        self.lost: list[str] = []
        self.resumes = 0


async def one_stream(session: aiohttp.ClientSession, base: str, body: dict, rec: Record) -> None:
    """A streamed completion, resumed with Last-Event-ID when its connection breaks."""
    request_id, last_id, sent = uuid.uuid4().hex, None, time.perf_counter()
    prev, got_first = sent, False
    for _ in range(6):
        headers = {"Accept": "text/event-stream", "X-Request-Id": request_id}
        if last_id is not None:
            headers["Last-Event-ID"] = last_id
        try:
            async with session.post(f"{base}/v1/completions", json=body, headers=headers) as resp:
                if resp.status != 200:
                    rec.lost.append(f"HTTP {resp.status}: {(await resp.text())[:200]}")
                    return
                async for raw in resp.content:
                    line = raw.decode().strip()
                    if line.startswith("id:"):
                        last_id = line[3:].strip()
                    if not line.startswith("data:") or line == "data: [DONE]":
                        if line == "data: [DONE]":
                            rec.done += 1
                            return
                        continue
                    chunk = json.loads(line[5:])
                    if "error" in chunk:
                        rec.lost.append(f"error in stream: {chunk['error']}")
                        return
                    now = time.perf_counter()
                    for _ in range(sum(len(c.get("token_ids") or []) for c in chunk["choices"])):
                        if not got_first:
                            rec.ttft.append((sent, now - sent))
                            got_first = True
                        else:
                            rec.gaps.append((now, now - prev))
                        prev = now
        except (aiohttp.ClientError, asyncio.TimeoutError):
            pass
        rec.resumes += 1
        await asyncio.sleep(0.1)
    rec.lost.append("not finished after 5 resumes")


async def clients(base: str, model: str, args, rec: Record, stopping: asyncio.Event) -> None:
    rng = random.Random(0)

    async def loop() -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
            while not stopping.is_set():
                prompt = [rng.randrange(100, 40000) for _ in range(args.prompt_len)]
                body = {"model": model, "prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0,
                        "ignore_eos": True, "stream": True, "return_token_ids": True}
                await one_stream(session, base, body, rec)

    await asyncio.gather(*(loop() for _ in range(args.streams)))


def admin_for(pid: int) -> tuple[str, str]:
    from stagemesh.entry.ops import admin_file

    entry = next(e for e in admin_file.running() if int(e["pid"]) == pid)
    return entry["url"], entry["key"]


def operation(admin: tuple[str, str], path: str, body: dict) -> None:
    """Start an operation and wait (in a thread) until it ends."""
    url, key = admin
    head = {"Authorization": f"Bearer {key}"}
    op = requests.post(url + path, json=body, headers=head, timeout=10).json()["operation"]
    while True:
        status = requests.get(url + "/admin/status", headers=head, timeout=10).json()
        last = status["last_operation"]
        if status["operation"] is None and last and last["id"] == op["id"]:
            assert last["state"] == "succeeded", last
            return
        time.sleep(0.5)


async def run(base: str, admin: tuple[str, str], dp: int, args, phases: Phases, rec: Record) -> None:
    model = requests.get(f"{base}/v1/models", timeout=5).json()["data"][0]["id"]
    stopping = asyncio.Event()
    load = asyncio.create_task(clients(base, model, args, rec, stopping))
    await asyncio.sleep(args.warmup)
    t = time.perf_counter()
    await asyncio.sleep(args.steady)
    phases.windows["steady"] = (t, time.perf_counter())
    for name, path, body in (("rollout", "/admin/rollout", {}),
                             ("scale-in", "/admin/scale", {"data_parallel_size": dp - 1})):
        t = time.perf_counter()
        await asyncio.to_thread(operation, admin, path, body)
        phases.windows[name] = (t, time.perf_counter())
        print(f"{name}: {phases.windows[name][1] - t:.1f} s", flush=True)
    stopping.set()
    await load


def p99(values: list[float]) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(0.99 * len(values)))] * 1000 if values else float("nan")


def report(phases: Phases, rec: Record) -> None:
    rows = {}
    for name in phases.windows:
        itl = [g for t, g in rec.gaps if phases.of(t) == name]
        ttft = [v for t, v in rec.ttft if phases.of(t) == name]
        rows[name] = (p99(itl), p99(ttft), max(itl, default=float("nan")) * 1000)
        print(f"{name:9s} ITL p99 {rows[name][0]:8.1f} ms, max {rows[name][2]:8.1f} ms ({len(itl)} gaps)   TTFT p99 "
              f"{rows[name][1]:8.1f} ms ({len(ttft)} requests)")
    base = rows["steady"]
    for name in ("rollout", "scale-in"):
        print(f"{name} / steady: ITL p99 {rows[name][0] / base[0]:.2f}x, TTFT p99 {rows[name][1] / base[1]:.2f}x, "
              f"ITL max {rows[name][2] / base[2]:.2f}x")
    print(f"requests completed {rec.done}, lost {len(rec.lost)}, streams resumed {rec.resumes}")
    for lost in rec.lost[:5]:
        print("  lost:", lost)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", default=None)
    p.add_argument("--layout", default="-dp 2 -pp 2 --api-server-count 2", help="`stagemesh serve` flags")
    p.add_argument("--streams", type=int, default=8, help="clients, each streaming one request after another")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--warmup", type=float, default=10.0, help="seconds of load before the steady window")
    p.add_argument("--steady", type=float, default=30.0, help="seconds of the steady window")
    p.add_argument("--shutdown-timeout", type=float, default=10.0, help="serve's --shutdown-timeout")
    args = p.parse_args()
    from kernels import cpu_ops, isa

    print(isa.describe(isa.cpu_flags(), cpu_ops.load() is not None))
    flags = shlex.split(args.layout)
    dp = int(flags[flags.index("-dp") + 1]) if "-dp" in flags else 1
    assert dp >= 2, "a scale-in needs -dp 2 or more"
    log = Path(tempfile.mkdtemp(prefix="stagemesh-rollout-")) / "serve.log"
    print(f"{os.cpu_count()} cores; serve {args.layout} {args.model or '(default model)'}; {args.streams} streams of "
          f"{args.prompt_len} in / {args.max_tokens} out; log {log}", flush=True)
    proc, base = start_serve([*([args.model] if args.model else []), *flags, "--threads", "1",
                              "--shutdown-timeout", str(args.shutdown_timeout)], log)
    phases, rec = Phases(), Record()
    try:
        asyncio.run(run(base, admin_for(proc.pid), dp, args, phases, rec))
    finally:
        stop(proc)
    report(phases, rec)


if __name__ == "__main__":
    main()
