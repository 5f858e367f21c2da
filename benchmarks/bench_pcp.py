"""Prefill context parallelism (-pcp) on CPU: a long prompt's time to first token with its prefill split over two
processes, against one process on one core and one process with two threads on the same two cores, through
`stagemesh serve` over HTTP, on the embedded default model (SmolLM2-135M-Instruct, fp32, real weights).

Layouts (a fresh serve each, alternating, --rounds rounds):
- `1x1`: one stage process, --threads 1: the baseline, one core;
- `1x2`: one stage process, --threads 2: the same two cores through torch's intra-op threads;
- `pcp2`: -pcp 2, two stage processes of --threads 1: each computes the tokens whose KV it keeps (half of every
  block's), every layer; the ceiling of its speed-up over `1x1` is 2 (two cores), less the two all-gathers and
  the merge per layer and the gather of the stage's rows.
Each round sends one short request (warm-up), then --reps prompts of each of --prompt-lens random tokens (distinct,
so prefix caching shares nothing), one at a time, max_tokens 1; TTFT is the client's time to the response. Prints,
per layout and length, the best and the median over all requests, and the ratios of `pcp2` to the others.

    .venv/bin/python benchmarks/bench_pcp.py [--rounds 2] [--prompt-lens 1024 2048] [--quick]
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).parent))

from serve_process import start_serve, stop  # noqa: E402

LAYOUTS = {"1x1": ["--threads", "1"], "1x2": ["--threads", "2"], "pcp2": ["-pcp", "2", "--threads", "1"]}
NAME = "SmolLM2-135M-Instruct"


def ttft(base: str, ids: list[int]) -> float:
    start = time.perf_counter()
    r = requests.post(f"{base}/v1/completions", json={"model": NAME, "prompt": ids, "max_tokens": 1,
                                                      "temperature": 0}, timeout=900)
    r.raise_for_status()
    return time.perf_counter() - start


def one_round(layout: str, args, rng: random.Random, log: Path) -> dict[int, list[float]]:
    log.unlink(missing_ok=True)
    proc, base = start_serve(["--device", "cpu", *LAYOUTS[layout]], log=log, timeout=600)
    try:
        ttft(base, [rng.randrange(100, 40000) for _ in range(16)])  # warm-up
        return {n: [ttft(base, [rng.randrange(100, 40000) for _ in range(n)]) for _ in range(args.reps)]
                for n in args.prompt_lens}
    finally:
        stop(proc)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompt-lens", type=int, nargs="+", default=[1024, 2048])
    p.add_argument("--reps", type=int, default=2, help="prompts of each length per round")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="one round of one 1024-token prompt")
    p.add_argument("--log-dir", type=Path, default=Path("/tmp"), help="where each serve's log goes")
    args = p.parse_args()
    if args.quick:
        args.prompt_lens, args.reps, args.rounds = [1024], 1, 1
    rng = random.Random(0)
    times: dict[str, dict[int, list[float]]] = {name: {n: [] for n in args.prompt_lens} for name in LAYOUTS}
    for r in range(args.rounds):
        for name in LAYOUTS:
            got = one_round(name, args, rng, args.log_dir / f"bench_pcp-{name}.log")
            for n, ts in got.items():
                times[name][n] += ts
            print(f"round {r + 1} {name}: " + ", ".join(f"{n} tokens {statistics.median(ts) * 1000:.0f} ms"
                                                       for n, ts in got.items()), flush=True)
    print("\nTTFT, ms (best / median over rounds x reps)")
    for n in args.prompt_lens:
        row = {name: (min(times[name][n]), statistics.median(times[name][n])) for name in LAYOUTS}
        print(f"  {n:5d} tokens: " + "   ".join(f"{name} {b * 1000:.0f} / {m * 1000:.0f}"
                                                 for name, (b, m) in row.items()))
        for base in ("1x1", "1x2"):
            print(f"        {base} / pcp2 (speed-up of -pcp 2): best {row[base][0] / row['pcp2'][0]:.2f}x, "
                  f"median {row[base][1] / row['pcp2'][1]:.2f}x" + ("  (ceiling 2.00x: two cores)"
                                                                   if base == "1x1" else ""))


if __name__ == "__main__":
    main()
