"""Disaggregated prefill against aggregated replicas on the same machine: `stagemesh serve -dp 2
--prefill-replicas 1` (one prefill and one decode replica) against `serve -dp 2` (both do both), alternating
round by round. The load: decode streams of 32 prompt / 256 output tokens while long prompts of 1,024 tokens
(16 output tokens) arrive; the figure is the streams' inter-token latency (p50, p99, max), which a long
prefill on a stream's replica interrupts, and the long prompts' TTFT, which the KV transfer lengthens.

    .venv/bin/python benchmarks/bench_disagg.py [--rounds 2 --streams 4 --long-prompts 6 --long-every 2.0]

Default model, fp32, prefix caching off (random prompts), one thread per stage process.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

import aiohttp
import requests

from serve_process import start_serve, stop

ARMS = {"aggregated": ["-dp", "2"], "disaggregated": ["-dp", "2", "--prefill-replicas", "1"]}


def start(arm: str, log: Path) -> tuple:
    return start_serve([*ARMS[arm], "--threads", "1", "--no-enable-prefix-caching"], log)


async def stream(session: aiohttp.ClientSession, base: str, model: str, prompt: list[int], max_tokens: int
                 ) -> list[float]:
    """Arrival times of a streamed completion's tokens (first one included), from its sending."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "return_token_ids": True}
    start, times = time.perf_counter(), []
    async with session.post(f"{base}/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.content:
            if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
                chunk = json.loads(line[6:])
                n = sum(len(c.get("token_ids") or []) for c in chunk["choices"])
                times += [time.perf_counter() - start] * n
    return times


async def load(base: str, args, rng: random.Random) -> dict:
    model = requests.get(f"{base}/v1/models", timeout=5).json()["data"][0]["id"]
    ids = lambda n: [rng.randrange(100, 40000) for _ in range(n)]  # noqa: E731
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800)) as session:
        await stream(session, base, model, ids(32), 4)  # warm up
        streams = [asyncio.create_task(stream(session, base, model, ids(32), 256)) for _ in range(args.streams)]
        await asyncio.sleep(args.long_every)
        longs = []
        for _ in range(args.long_prompts):
            longs.append(asyncio.create_task(stream(session, base, model, ids(1024), 16)))
            await asyncio.sleep(args.long_every)
        decode_times = await asyncio.gather(*streams)
        long_times = await asyncio.gather(*longs)
    gaps = sorted(b - a for t in decode_times for a, b in zip(t, t[1:]))
    q = lambda p: gaps[min(len(gaps) - 1, int(p * len(gaps)))] * 1000  # noqa: E731
    return {"itl_p50_ms": q(0.5), "itl_p99_ms": q(0.99), "itl_max_ms": gaps[-1] * 1000,
            "long_ttft_ms": statistics.mean(t[0] for t in long_times) * 1000,
            "decode_tok_s": sum(len(t) for t in decode_times) / max(t[-1] for t in decode_times)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--streams", type=int, default=4, help="decode streams of 32 in / 256 out")
    p.add_argument("--long-prompts", type=int, default=6, help="prompts of 1,024 in / 16 out during the streams")
    p.add_argument("--long-every", type=float, default=2.0, help="seconds between two long prompts")
    args = p.parse_args()
    log_dir = Path(tempfile.mkdtemp(prefix="stagemesh-disagg-"))
    print(f"{os.cpu_count()} cores; {args.streams} streams of 32/256 while {args.long_prompts} prompts of 1024/16 "
          f"arrive every {args.long_every}s; logs in {log_dir}", flush=True)
    results: dict[str, list[dict]] = {arm: [] for arm in ARMS}
    for r in range(args.rounds):
        for arm in (ARMS if r % 2 == 0 else reversed(list(ARMS))):
            proc, base = start(arm, log_dir / f"serve-{arm}.log")
            try:
                res = asyncio.run(load(base, args, random.Random(r)))
            finally:
                stop(proc)
            results[arm].append(res)
            print(f"round {r + 1} {arm:14s} ITL p50 {res['itl_p50_ms']:6.1f} ms  p99 {res['itl_p99_ms']:7.1f} ms  "
                  f"max {res['itl_max_ms']:7.1f} ms  long-prompt TTFT {res['long_ttft_ms']:7.0f} ms  "
                  f"decode {res['decode_tok_s']:5.1f} tok/s", flush=True)
    med = {arm: {k: statistics.median(x[k] for x in rs) for k in rs[0]} for arm, rs in results.items()}
    for arm, m in med.items():
        print(f"median {arm:14s} ITL p50 {m['itl_p50_ms']:.1f} / p99 {m['itl_p99_ms']:.1f} / max "
              f"{m['itl_max_ms']:.1f} ms, long TTFT {m['long_ttft_ms']:.0f} ms, decode {m['decode_tok_s']:.1f} tok/s")
    a, d = med["aggregated"], med["disaggregated"]
    print(f"disaggregated / aggregated: ITL p99 {d['itl_p99_ms'] / a['itl_p99_ms']:.2f}x, max "
          f"{d['itl_max_ms'] / a['itl_max_ms']:.2f}x, p50 {d['itl_p50_ms'] / a['itl_p50_ms']:.2f}x, long TTFT "
          f"{d['long_ttft_ms'] / a['long_ttft_ms']:.2f}x, decode throughput "
          f"{d['decode_tok_s'] / a['decode_tok_s']:.2f}x")


if __name__ == "__main__":
    main()
