"""The router's balancing policies on a shared-prefix workload: `stagemesh serve -dp 2` on the default model,
one mesh per policy (kv-aware, cache-aware, least-load, round-robin), the policies alternating round by round so that
load from elsewhere hits them all. The workload (`stagemesh bench`'s prefix_repetition, as vLLM bench's):
requests that share a few long prefixes (system prompts), each with a suffix of its own, all sent at once
under a concurrency limit. Prints per policy and round: the prefix-cache hit rate over both replicas (from
the router's /metrics), mean and p50 TTFT, and output throughput; then the medians.

    .venv/bin/python benchmarks/bench_prefix_policies.py [--rounds 2 --num-prompts 64 --prefixes 4
        --prefix-len 384 --max-concurrency 16 --kv-cache-memory BYTES]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests

from serve_process import start_serve, stop

POLICIES = ("kv-aware", "cache-aware", "least-load", "round-robin")


def prefix_counters(base: str) -> tuple[float, float]:
    """(prompt tokens looked up, found) in the prefix caches, summed over the replicas."""
    queries = hits = 0.0
    for line in requests.get(f"{base}/metrics", timeout=10).text.splitlines():
        m = re.match(r"vllm:prefix_cache_(queries|hits)_total\{.*\} ([0-9.e+]+)$", line)
        if m:
            if m.group(1) == "queries":
                queries += float(m.group(2))
            else:
                hits += float(m.group(2))
    return queries, hits


def run_policy(policy: str, args, log_dir: Path) -> dict:
    kv = ["--kv-cache-memory", str(args.kv_cache_memory)] if args.kv_cache_memory else []
    serve, base = start_serve(["-dp", "2", "--policy", policy, *kv], log_dir / f"serve-{policy}.log")
    try:
        time.sleep(2)  # the router's load figures settle
        before = prefix_counters(base)
        bench = subprocess.run(
            [sys.executable, "-m", "stagemesh", "bench", "--base-url", base, "--num-prompts", str(args.num_prompts),
             "--prefix-repetition-num-prefixes", str(args.prefixes), "--prefix-repetition-prefix-len",
             str(args.prefix_len), "--input-len-range", args.suffix_len, "--output-len-range", args.output_len,
             "--max-concurrency", str(args.max_concurrency), "--seed", str(args.seed), "--no-progress",
             "--json", "-"], capture_output=True, text=True, timeout=1800)
        if bench.returncode != 0:
            sys.exit(f"bench ({policy}) failed:\n{bench.stdout[-3000:]}\n{bench.stderr[-3000:]}")
        summary = json.loads(bench.stdout[bench.stdout.index("{"):])
        after = prefix_counters(base)
        queries, hits = after[0] - before[0], after[1] - before[1]
        return {"hit_rate": hits / queries if queries else 0.0, "mean_ttft_ms": summary["mean_ttft_ms"],
                "p50_ttft_ms": summary["p50_ttft_ms"], "output_throughput": summary["output_throughput"],
                "failed": summary["failed_requests"]}
    finally:
        stop(serve)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES))
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--prefixes", type=int, default=4)
    p.add_argument("--prefix-len", type=int, default=384)
    p.add_argument("--suffix-len", default="16:64")
    p.add_argument("--output-len", default="16:32")
    p.add_argument("--max-concurrency", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kv-cache-memory", type=int, default=None,
                   help="KV bytes per stage: below what all prefixes need, a replica's cache holds only some")
    args = p.parse_args()
    log_dir = Path(tempfile.mkdtemp(prefix="stagemesh-prefix-policies-"))
    print(f"serve -dp 2 on the default model, {os.cpu_count()} cores; {args.num_prompts} requests over "
          f"{args.prefixes} prefixes of {args.prefix_len} tokens, suffixes {args.suffix_len}, outputs "
          f"{args.output_len}, at most {args.max_concurrency} in flight, KV per stage "
          f"{args.kv_cache_memory or 'default'}; logs in {log_dir}", flush=True)
    policies = tuple(args.policies)
    results: dict[str, list[dict]] = {policy: [] for policy in policies}
    for r in range(args.rounds):
        order = policies if r % 2 == 0 else tuple(reversed(policies))
        for policy in order:
            res = run_policy(policy, args, log_dir)
            results[policy].append(res)
            print(f"round {r + 1} {policy:12s} hit rate {res['hit_rate']:.1%}  mean TTFT {res['mean_ttft_ms']:8.1f} ms"
                  f"  p50 TTFT {res['p50_ttft_ms']:8.1f} ms  {res['output_throughput']:6.1f} tok/s"
                  f"  failed {res['failed']}", flush=True)
    print("median over the rounds:")
    for policy in policies:
        rs = results[policy]
        med = {k: statistics.median(x[k] for x in rs) for k in ("hit_rate", "mean_ttft_ms", "output_throughput")}
        print(f"  {policy:12s} hit rate {med['hit_rate']:.1%}  mean TTFT {med['mean_ttft_ms']:8.1f} ms  "
              f"{med['output_throughput']:6.1f} tok/s")


if __name__ == "__main__":
    main()
