"""Embedding throughput (texts/s): `stagemesh serve --runner pooling` on the embedded default model (converted to
embed: last-token pooled, normalized) through /v1/embeddings, against transformers in this process on the same
weights (batches of the same size, padded) measured in the same run, and vLLM's CPU build's pooling runner when
--vllm URL names one serving the same model (docs/benchmarks.md: its venv; `vllm serve MODEL --runner pooling`).
Checks the served embeddings against transformers' first (cosine).

    PYTHONPATH=. .venv/bin/python benchmarks/bench_embeddings.py [--texts 256] [--batch 32] [--concurrency 2]
        [--rounds 3] [--dtype float32] [--vllm http://127.0.0.1:8001 --vllm-model smol]
"""
from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import time
from pathlib import Path

import aiohttp
import numpy as np
import torch

from bench_kv_tiers_restart import isa
from serve_process import start_serve, stop
from stagemesh.core.default_model import DEFAULT_MODEL_NAME, default_model_dir


def texts(n: int, seed: int = 0) -> list[str]:
    words = "the of and to in a is that for it as was with be by on not he this are or his from at which".split()
    rng = random.Random(seed)
    return [" ".join(rng.choice(words) for _ in range(rng.randint(16, 128))) for _ in range(n)]


async def served_rate(base: str, model: str, items: list[str], batch: int, concurrency: int) -> float:
    """texts/s through /v1/embeddings: batches of `batch` texts, `concurrency` requests at once."""
    chunks = [items[i:i + batch] for i in range(0, len(items), batch)]
    gate = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession() as session:
        async def one(chunk):
            async with gate, session.post(f"{base}/v1/embeddings", json={"model": model, "input": chunk}) as r:
                assert r.status == 200, await r.text()
                await r.read()
        start = time.perf_counter()
        await asyncio.gather(*(one(c) for c in chunks))
        return len(items) / (time.perf_counter() - start)


async def served_vectors(base: str, model: str, items: list[str]) -> np.ndarray:
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{base}/v1/embeddings", json={"model": model, "input": items}) as r:
            return np.array([d["embedding"] for d in (await r.json())["data"]])


@torch.inference_mode()
def transformers_rate(model_dir: Path, items: list[str], batch: int, dtype: torch.dtype) -> tuple[float, np.ndarray]:
    """texts/s of transformers' AutoModel on padded batches (last real token pooled, normalized), and the first
    batch's vectors."""
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.pad_token = tok.pad_token or tok.eos_token
    tok.padding_side = "right"
    model = AutoModel.from_pretrained(model_dir, dtype=dtype).eval()
    first = None
    start = time.perf_counter()
    for i in range(0, len(items), batch):
        enc = tok(items[i:i + batch], return_tensors="pt", padding=True)
        hidden = model(**enc).last_hidden_state
        last = enc["attention_mask"].sum(1) - 1
        vectors = torch.nn.functional.normalize(hidden[torch.arange(hidden.shape[0]), last].float(), dim=-1)
        first = vectors.numpy() if first is None else first
    return len(items) / (time.perf_counter() - start), first


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--texts", type=int, default=256)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--vllm", default=None, help="base URL of a vLLM CPU server running --runner pooling")
    p.add_argument("--vllm-model", default=DEFAULT_MODEL_NAME)
    args = p.parse_args()
    items, model_dir = texts(args.texts), default_model_dir()
    torch.set_num_threads(2)
    log = Path(tempfile.mkdtemp()) / "serve.log"
    proc, base = start_serve(["--runner", "pooling", "--dtype", args.dtype, "--no-enable-prefix-caching"], log)
    try:
        check = asyncio.run(served_vectors(base, DEFAULT_MODEL_NAME, items[:args.batch]))
        hf_rates, mesh_rates, vllm_rates = [], [], []
        for _ in range(args.rounds):  # the arms alternate, so that a busy moment of the machine hits both
            mesh_rates.append(asyncio.run(served_rate(base, DEFAULT_MODEL_NAME, items, args.batch, args.concurrency)))
            if args.vllm:
                vllm_rates.append(asyncio.run(served_rate(args.vllm, args.vllm_model, items, args.batch,
                                                          args.concurrency)))
    finally:
        stop(proc)
    for _ in range(args.rounds):  # (the server stopped: transformers gets the cores to itself)
        rate, reference = transformers_rate(model_dir, items, args.batch, getattr(torch, args.dtype))
        hf_rates.append(rate)
    cosine = float(np.min(np.sum(check * reference, axis=1)))
    print(f"machine: {isa()}; model {DEFAULT_MODEL_NAME} ({args.dtype}), {args.texts} texts of 16-128 words, "
          f"batches of {args.batch}, {args.concurrency} requests at once, {args.rounds} rounds (median)")
    print(f"served vs transformers embeddings: min cosine {cosine:.6f}")
    hf = statistics.median(hf_rates)
    print(f"transformers in-process: {hf:8.1f} texts/s")
    mesh = statistics.median(mesh_rates)
    print(f"stagemesh serve:         {mesh:8.1f} texts/s  ({mesh / hf:.2f}x transformers)")
    if vllm_rates:
        v = statistics.median(vllm_rates)
        print(f"vLLM CPU (pooling):      {v:8.1f} texts/s  (stagemesh / vLLM: {mesh / v:.2f}x)")


if __name__ == "__main__":
    main()
