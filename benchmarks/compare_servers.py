"""The same `stagemesh bench` workload against two running OpenAI-compatible servers, alternating round by
round (A, B, B, A, ...) so that load from elsewhere on the machine hits both: stagemesh against vLLM's CPU
build (`vllm serve` in its own venv), llama.cpp's server (`--prompt-format text`), or two stagemesh layouts.
Prints each round's output throughput, mean TTFT and mean TPOT per server, then the medians and the
ratio A / B.

    .venv/bin/python benchmarks/compare_servers.py --a http://127.0.0.1:8000 --b http://127.0.0.1:8001 \
        [--rounds 3] [-- bench flags, e.g. --num-prompts 32 --input-len-range 16:256 --output-len-range 16:128]

Both servers get the same seeded requests (token ids, or their text with --prompt-format text), with
ignore_eos so that each produces exactly the tokens asked for (llama-cpp-python's server ignores it and may
stop at an EOS: its output lengths are printed); llama-cpp-python's server streams no usage, so `stagemesh
bench` counts its tokens again with its POST /extras/tokenize after each round (each round's line says how the
tokens were counted; `-- --count-tokens server` counts both servers that way). Give each server's model name with
--model-a / --model-b when /v1/models does not list the one to use first. Prefix caching should be off on
both (the seeded prompts repeat between rounds).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

METRICS = ("output_throughput", "mean_ttft_ms", "mean_tpot_ms")


def bench(url: str, model: str | None, extra: list[str]) -> dict:
    argv = [sys.executable, "-m", "stagemesh", "bench", "--base-url", url, "--no-progress", "--json", "-", *extra]
    if model:
        argv += ["--model", model]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=3600)
    if out.returncode != 0:
        sys.exit(f"bench against {url} failed:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    return json.loads(out.stdout[out.stdout.index("{"):])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--a", required=True, help="base URL of server A (e.g. stagemesh)")
    p.add_argument("--b", required=True, help="base URL of server B (e.g. vLLM)")
    p.add_argument("--model-a", default=None)
    p.add_argument("--model-b", default=None)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("bench_args", nargs=argparse.REMAINDER, help="flags for `stagemesh bench` (after --)")
    args = p.parse_args()
    extra = [a for a in args.bench_args if a != "--"]
    results: dict[str, list[dict]] = {"A": [], "B": []}
    for r in range(args.rounds):
        order = ("A", "B") if r % 2 == 0 else ("B", "A")
        for name in order:
            url, model = (args.a, args.model_a) if name == "A" else (args.b, args.model_b)
            s = bench(url, model, extra)
            if s["failed_requests"]:
                sys.exit(f"{name} ({url}) failed {s['failed_requests']} request(s): {s.get('errors')}")
            results[name].append(s)
            print(f"round {r + 1} {name} ({url}): {s['output_throughput']:.1f} tok/s, mean TTFT "
                  f"{s['mean_ttft_ms']:.0f} ms, mean TPOT {s['mean_tpot_ms']:.1f} ms; {s['total_input_tokens']} "
                  f"prompt / {s['total_output_tokens']} output tokens, counted by "
                  f"{', '.join(s.get('tokens_counted_by') or ['?'])}", flush=True)
    med = {name: {m: statistics.median(s[m] for s in runs) for m in METRICS} for name, runs in results.items()}
    for name in ("A", "B"):
        print(f"median {name}: {med[name]['output_throughput']:.1f} tok/s, mean TTFT "
              f"{med[name]['mean_ttft_ms']:.0f} ms, mean TPOT {med[name]['mean_tpot_ms']:.1f} ms")
    print(f"A / B: throughput {med['A']['output_throughput'] / med['B']['output_throughput']:.2f}x, TPOT "
          f"{med['A']['mean_tpot_ms'] / med['B']['mean_tpot_ms']:.2f}x (below 1: A is faster per token)")


if __name__ == "__main__":
    main()
