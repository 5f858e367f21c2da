"""Interactive TTFT with and without a running batch (the Batch API, --batch-dir): `stagemesh serve` on the embedded
default model; interactive streamed chat requests (p50 / p99 TTFT) alone, then while a batch of chat lines runs,
under --scheduling-policy priority (batch lines at priority 10, below interactive requests at 0) and under fcfs
(the batch's lines as interactive as any), each server measured alone first in the same run.

    PYTHONPATH=benchmarks:. .venv/bin/python benchmarks/bench_batch_ttft.py [--requests 32] [--concurrency 2]
        [--batch-lines 400] [--batch-concurrency 8]
"""
from __future__ import annotations

import argparse
import asyncio
import io
import json
import statistics
import tempfile
import time
from pathlib import Path

import aiohttp
import openai

from bench_kv_tiers_restart import isa
from serve_process import start_serve, stop
from stagemesh.core.default_model import DEFAULT_MODEL_NAME

QUESTIONS = ["What is the capital of France?", "Name three primary colors.", "What is 12 times 7?",
             "Write one sentence about the sea.", "Who wrote Hamlet?", "What does a CPU do?"]


async def ttfts(base: str, n: int, concurrency: int) -> list[float]:
    """Seconds to the first content token of `n` streamed chat requests, `concurrency` at once."""
    gate, out = asyncio.Semaphore(concurrency), []
    async with aiohttp.ClientSession() as session:
        async def one(i: int) -> None:
            body = {"model": DEFAULT_MODEL_NAME, "stream": True, "max_tokens": 16, "temperature": 0,
                    "messages": [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)] + f" ({i})"}]}
            async with gate:
                start = time.perf_counter()
                async with session.post(f"{base}/v1/chat/completions", json=body) as r:
                    async for line in r.content:
                        if line.startswith(b"data: {") and b'"content"' in line:
                            out.append(time.perf_counter() - start)
                            break
                    await r.read()
        await asyncio.gather(*(one(i) for i in range(n)))
    return out


def start_batch(base: str, lines: int) -> tuple[openai.OpenAI, str]:
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
    rows = [json.dumps({"custom_id": f"b{i}", "method": "POST", "url": "/v1/chat/completions",
                        "body": {"model": DEFAULT_MODEL_NAME, "max_tokens": 64, "temperature": 0, "ignore_eos": True,
                                 "messages": [{"role": "user", "content": f"Tell a story about the number {i}."}]}})
            for i in range(lines)]
    f = client.files.create(file=("batch.jsonl", io.BytesIO("\n".join(rows).encode())), purpose="batch")
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    return client, batch.id


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def arm(policy: str, args) -> dict:
    work = Path(tempfile.mkdtemp())
    proc, base = start_serve(["--batch-dir", str(work / "batches"), "--batch-concurrency",
                              str(args.batch_concurrency), "--scheduling-policy", policy], work / "serve.log")
    try:
        alone = asyncio.run(ttfts(base, args.requests, args.concurrency))
        client, batch_id = start_batch(base, args.batch_lines)
        while client.batches.retrieve(batch_id).request_counts.completed < args.batch_concurrency:
            time.sleep(0.2)  # the batch is running at its full width
        loaded = asyncio.run(ttfts(base, args.requests, args.concurrency))
        batch = client.batches.retrieve(batch_id)
        still = batch.status in ("in_progress", "validating")
        client.batches.cancel(batch_id)
        return {"alone": alone, "loaded": loaded, "batch_done": batch.request_counts.completed, "running": still}
    finally:
        stop(proc)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--batch-lines", type=int, default=400)
    p.add_argument("--batch-concurrency", type=int, default=8)
    args = p.parse_args()
    print(f"machine: {isa()}; {args.requests} interactive streamed chats ({args.concurrency} at once, 16 tokens), "
          f"a batch of {args.batch_lines} chat lines (64 tokens each, --batch-concurrency {args.batch_concurrency})")
    for policy in ("priority", "fcfs"):
        r = arm(policy, args)
        a50, a99 = statistics.median(r["alone"]), pct(r["alone"], 0.99)
        l50, l99 = statistics.median(r["loaded"]), pct(r["loaded"], 0.99)
        print(f"--scheduling-policy {policy:8s} TTFT alone p50 {a50 * 1000:7.1f} ms p99 {a99 * 1000:7.1f} ms | with "
              f"the batch p50 {l50 * 1000:7.1f} ms p99 {l99 * 1000:7.1f} ms ({l50 / a50:.2f}x, {l99 / a99:.2f}x); "
              f"batch lines done meanwhile {r['batch_done']}{'' if r['running'] else ' (the batch had ended)'}")


if __name__ == "__main__":
    main()
