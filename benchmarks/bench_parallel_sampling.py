"""Parallel sampling: one request with n=4 against four separate requests for the same prompt, sent
at once, alternating in the same run on the same replica (default model, one stage).

The n=4 request's choices are sampled with seeds s..s+3 and share the prompt's KV blocks (the
siblings start after the first choice's first token, on its replica, and hit the prefix cache);
four separate requests with those seeds arrive together and each computes the whole prompt. Same
seeds, same tokens: the script checks the texts are equal.

    .venv/bin/python benchmarks/bench_parallel_sampling.py [--rounds 6] [--prompt-len 512] [--tokens 32]
"""
from __future__ import annotations

import argparse
import re
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))

from mesh import Mesh, Router  # noqa: E402

from stagemesh.core.default_model import DEFAULT_MODEL_NAME, default_model_dir  # noqa: E402

N = 4


def complete(base: str, prompt: list[int], tokens: int, seed: int, n: int) -> list[str]:
    body = {"model": DEFAULT_MODEL_NAME, "prompt": prompt, "max_tokens": tokens, "ignore_eos": True,
            "temperature": 1.0, "seed": seed, "n": n}
    resp = requests.post(f"{base}/v1/completions", json=body, timeout=600)
    resp.raise_for_status()
    return [c["text"] for c in sorted(resp.json()["choices"], key=lambda c: c["index"])]


def prefix_hits(base: str) -> float:
    page = requests.get(f"{base}/metrics", timeout=30).text
    return sum(float(v) for v in re.findall(r"^vllm:prefix_cache_hits_total\{[^}]*\} (\S+)$", page, re.M))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()
    model = default_model_dir()
    rows: dict[str, list[tuple[float, float]]] = {"n=4, one request": [], "4 requests": []}
    same = True
    with Mesh(model, [30], stage_args=("--threads", "2")) as mesh, \
            Router(model, [mesh.address], extra=("--health-interval", "0.5")) as router, \
            ThreadPoolExecutor(N) as pool:
        base = router.base_url
        complete(base, list(range(100, 116)), 4, 0, N)  # warm-up
        for r in range(args.rounds):
            # a fresh prompt per round and per arm: no hits from an earlier round
            prompts = {name: [1000 + (r * 2 + i) * 7 + (t * 13) % 20000 for t in range(args.prompt_len)]
                       for i, name in enumerate(rows)}
            order = list(rows) if r % 2 == 0 else list(reversed(rows))  # alternate which arm goes first
            texts = {}
            for name in order:
                hits, start = prefix_hits(base), time.perf_counter()
                if name.startswith("n="):
                    texts[name] = complete(base, prompts[name], args.tokens, 7 * r, N)
                else:
                    texts[name] = list(pool.map(lambda i: complete(base, prompts[name], args.tokens, 7 * r + i, 1)[0],
                                                range(N)))
                wall = time.perf_counter() - start
                time.sleep(1.5)  # the statistics stream reaches the router every second
                rows[name].append((wall, prefix_hits(base) - hits))
            # same seeds on different prompts differ; check tokens on the same prompt once per round instead
            solo = [complete(base, prompts["n=4, one request"], args.tokens, 7 * r + i, 1)[0] for i in range(N)]
            same &= solo == texts["n=4, one request"]
    print(f"default model, one stage (2 threads), {args.prompt_len}-token prompt, {args.tokens} tokens per choice, "
          f"{N} choices, temperature 1, {args.rounds} rounds alternating")
    for name, v in rows.items():
        wall = statistics.median(w for w, _ in v)
        print(f"{name:18s} wall {wall:6.2f} s   {N * args.tokens / wall:6.1f} tok/s   "
              f"prefix-cache hits {statistics.median(h for _, h in v):6.0f} tokens")
    a, b = (statistics.median(w for w, _ in v) for v in rows.values())
    print(f"n=4 / separate throughput: {b / a:.2f}x; choices equal to separate seeded requests: {same}")


if __name__ == "__main__":
    main()
