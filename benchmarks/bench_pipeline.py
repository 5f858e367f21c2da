"""Pipeline efficiency on this machine's cores: PP=2 with each stage pinned to one core
against PP=1 on one core, 32 concurrent sequences of the default model. Same run.

    .venv/bin/python benchmarks/bench_pipeline.py [--seqs 32] [--prompt 32] [--tokens 64]
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))

from mesh import Mesh  # noqa: E402

from stagemesh.default_model import default_model_dir  # noqa: E402
from stagemesh.sampling_params import SamplingParams  # noqa: E402


def throughput(split: list[int], cores: list[str], prompts, tokens: int, handoff: str) -> float:
    model = default_model_dir()
    pins = {i: ["--cpu-affinity", core] for i, core in enumerate(cores)}
    with Mesh(model, split, handoff=handoff, per_stage_args=pins) as mesh:
        mesh.generate(prompts[:2], SamplingParams(max_tokens=4))  # warm-up
        start = time.perf_counter()
        out = mesh.generate(prompts, SamplingParams(max_tokens=tokens, ignore_eos=True))
        elapsed = time.perf_counter() - start
    return sum(len(o) for o in out) / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seqs", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--handoff", default="nccl")
    parser.add_argument("--layer-split", default="15,15", help="PP=2 split (19,11 measured slower here)")
    args = parser.parse_args()
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(args.prompt)] for _ in range(args.seqs)]
    one = throughput([30], ["0"], prompts, args.tokens, args.handoff)
    two = throughput([int(x) for x in args.layer_split.split(",")], ["0", "1"], prompts, args.tokens, args.handoff)
    print(f"default model, {args.seqs} sequences, {args.prompt}-token prompts, {args.tokens} tokens each, "
          f"{args.handoff} handoff")
    print(f"PP=1, one core      : {one:7.1f} output tokens/s")
    print(f"PP=2, a core a stage: {two:7.1f} output tokens/s (layer split {args.layer_split})")
    print(f"ratio               : {two / one:7.2f}x (target >= 1.7)")


if __name__ == "__main__":
    main()
