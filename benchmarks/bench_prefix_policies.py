"""The router's balancing policies on a shared-prefix workload: `stagemesh serve -dp 2` on the default model,
one mesh per policy (kv-aware, cache-aware, least-load, round-robin), the policies alternating round by round so that
load from elsewhere hits them all. The workload (`stagemesh bench`'s prefix_repetition, as vLLM bench's):
requests that share a few long prefixes (system prompts), each with a suffix of its own, all sent at once
under a concurrency limit. Prints per policy and round: the prefix-cache hit rate over both replicas (from
the router's /metrics), mean and p50 TTFT, and output throughput; then the medians.

With --kv-offloading-size GiB every mesh gets a host KV tier of that size (docs/kv-tiers.md); with
--compare-tiers each policy (default: kv-aware alone) runs twice per round, without KV tiers and with a host
tier of --kv-offloading-size GiB (default 1), the two alternating round by round (issue 44: kv-aware routing
with tiers against without). Give a --kv-cache-memory under what the prefixes need, or the tiers have nothing
to do: loads from the host tier count as prefix-cache hits.

    .venv/bin/python benchmarks/bench_prefix_policies.py [--rounds 2 --num-prompts 64 --prefixes 4
        --prefix-len 384 --max-concurrency 16 --kv-cache-memory BYTES --kv-offloading-size GiB --compare-tiers]
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

from serve_process import free_port, start_serve, stop

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


def host_loads(metrics_port: int | None) -> float:
    """KV blocks the replicas loaded back from their host tiers (the schedulers' /metrics, replica r's on
    --metrics-port + 2r with one stage each); their tokens are in the prefix-cache hits too."""
    if metrics_port is None:
        return 0.0
    blocks = 0.0
    for r in range(2):
        text = requests.get(f"http://127.0.0.1:{metrics_port + 2 * r}/metrics", timeout=10).text
        for line in text.splitlines():
            m = re.match(r'stagemesh:kv_tier_loaded_blocks_total\{.*tier="host".*\} ([0-9.e+]+)$', line)
            if m:
                blocks += float(m.group(1))
    return blocks


def run_policy(config: tuple[str, str, float | None], args, log_dir: Path) -> dict:
    label, policy, host_gib = config
    kv = ["--kv-cache-memory", str(args.kv_cache_memory)] if args.kv_cache_memory else []
    metrics_port = None
    if host_gib:
        metrics_port = free_port()
        kv += ["--kv-offloading-size", str(host_gib), "--metrics-port", str(metrics_port)]
    serve, base = start_serve(["-dp", "2", "--policy", policy, *kv], log_dir / f"serve-{label}.log")
    try:
        time.sleep(2)  # the router's load figures settle
        before, loads_before = prefix_counters(base), host_loads(metrics_port)
        bench = subprocess.run(
            [sys.executable, "-m", "stagemesh", "bench", "--base-url", base, "--num-prompts", str(args.num_prompts),
             "--prefix-repetition-num-prefixes", str(args.prefixes), "--prefix-repetition-prefix-len",
             str(args.prefix_len), "--input-len-range", args.suffix_len, "--output-len-range", args.output_len,
             "--max-concurrency", str(args.max_concurrency), "--seed", str(args.seed), "--no-progress",
             "--json", "-"], capture_output=True, text=True, timeout=1800)
        if bench.returncode != 0:
            sys.exit(f"bench ({label}) failed:\n{bench.stdout[-3000:]}\n{bench.stderr[-3000:]}")
        summary = json.loads(bench.stdout[bench.stdout.index("{"):])
        after = prefix_counters(base)
        queries, hits = after[0] - before[0], after[1] - before[1]
        host_tokens = (host_loads(metrics_port) - loads_before) * args.block_size
        return {"hit_rate": hits / queries if queries else 0.0,
                "host_rate": host_tokens / queries if queries else 0.0, "mean_ttft_ms": summary["mean_ttft_ms"],
                "p50_ttft_ms": summary["p50_ttft_ms"], "output_throughput": summary["output_throughput"],
                "failed": summary["failed_requests"]}
    finally:
        stop(serve)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--policies", nargs="+", choices=POLICIES, default=None,
                   help="default: all four; with --compare-tiers, kv-aware")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--prefixes", type=int, default=4)
    p.add_argument("--prefix-len", type=int, default=384)
    p.add_argument("--suffix-len", default="16:64")
    p.add_argument("--output-len", default="16:32")
    p.add_argument("--max-concurrency", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kv-cache-memory", type=int, default=None,
                   help="KV bytes per stage: below what all prefixes need, a replica's cache holds only some")
    p.add_argument("--block-size", type=int, default=16, help="serve's (its default): to count tier loads in tokens")
    p.add_argument("--kv-offloading-size", type=float, default=None, metavar="GiB",
                   help="a host KV tier of this size on each replica (serve's flag); with --compare-tiers, the "
                        "tiered side's (default 1)")
    p.add_argument("--compare-tiers", action="store_true",
                   help="each policy without KV tiers and with a host tier, alternating")
    args = p.parse_args()
    if args.policies is None:
        args.policies = ["kv-aware"] if args.compare_tiers else list(POLICIES)
    log_dir = Path(tempfile.mkdtemp(prefix="stagemesh-prefix-policies-"))
    host = (f"off and {args.kv_offloading_size or 1} GiB" if args.compare_tiers
            else f"{args.kv_offloading_size} GiB" if args.kv_offloading_size else "off")
    print(f"serve -dp 2 on the default model, {os.cpu_count()} cores; {args.num_prompts} requests over "
          f"{args.prefixes} prefixes of {args.prefix_len} tokens, suffixes {args.suffix_len}, outputs "
          f"{args.output_len}, at most {args.max_concurrency} in flight, KV per stage "
          f"{args.kv_cache_memory or 'default'}, host KV tier {host}; logs in {log_dir}", flush=True)
    if args.compare_tiers:
        configs = tuple(c for policy in args.policies
                        for c in ((policy, policy, None), (f"{policy}+host", policy, args.kv_offloading_size or 1)))
    else:
        configs = tuple((policy, policy, args.kv_offloading_size) for policy in args.policies)
    labels = tuple(c[0] for c in configs)
    results: dict[str, list[dict]] = {label: [] for label in labels}
    width = max(12, *(len(label) for label in labels))
    for r in range(args.rounds):
        order = configs if r % 2 == 0 else tuple(reversed(configs))
        for config in order:
            res = run_policy(config, args, log_dir)
            policy = config[0]
            results[policy].append(res)
            print(f"round {r + 1} {policy:{width}s} hit rate {res['hit_rate']:.1%}  mean TTFT "
                  f"{res['mean_ttft_ms']:8.1f} ms  p50 TTFT {res['p50_ttft_ms']:8.1f} ms  "
                  f"{res['output_throughput']:6.1f} tok/s"
                  f"  failed {res['failed']}" + (f"  (hits from the host tier {res['host_rate']:.1%})"
                                                if config[2] else ""), flush=True)
    print("median over the rounds:")
    meds = {}
    for policy in labels:
        rs = results[policy]
        med = meds[policy] = {k: statistics.median(x[k] for x in rs)
                              for k in ("hit_rate", "mean_ttft_ms", "p50_ttft_ms", "output_throughput")}
        print(f"  {policy:{width}s} hit rate {med['hit_rate']:.1%}  mean TTFT {med['mean_ttft_ms']:8.1f} ms  "
              f"p50 TTFT {med['p50_ttft_ms']:8.1f} ms  {med['output_throughput']:6.1f} tok/s")
    if args.compare_tiers:
        for policy in args.policies:
            off, on = meds[policy], meds[f"{policy}+host"]
            print(f"  {policy}: host tier / none: mean TTFT {on['mean_ttft_ms'] / off['mean_ttft_ms']:.2f}x, p50 TTFT "
                  f"{on['p50_ttft_ms'] / off['p50_ttft_ms']:.2f}x, throughput "
                  f"{on['output_throughput'] / off['output_throughput']:.2f}x")


if __name__ == "__main__":
    main()
