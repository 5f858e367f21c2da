"""What a decode step costs in the stages beyond the model, at batch 1: a tiny model, so compute is small.

Real replicas (scheduler + stage processes on loopback) of a 4-layer tiny llama in four layouts: one
stage (pp1), PP=2 over the grpc handoff, PP=2 over the nccl handoff (gloo on CPU), and one stage of TP=2 (rank 0
and a follower process). One greedy request of --tokens tokens each, synchronous scheduling (each
step waits for the one before: the step path end to end, once per token) and async (steps run ahead,
the first stage filling in the last one's tokens). Per step: run time (the request's decode time over
its steps), the stages' model time (summed over stages, as the scheduler counts it) and the
difference, the overhead: scheduler, RPCs, step order, handoff, follower broadcast. Layouts and modes
alternate for --rounds rounds; medians are printed.

    .venv/bin/python benchmarks/bench_stage_step_overhead.py [--tokens 256] [--rounds 2]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))

from mesh import Mesh  # noqa: E402
from tiny_models import make_tiny_model  # noqa: E402

from stagemesh.core.sampling_params import SamplingParams  # noqa: E402
from stagemesh.v1 import scheduler_pb2  # noqa: E402

LAYOUTS = {"pp1": ([4], [1], "grpc"), "pp2-grpc": ([2, 2], [1, 1], "grpc"), "pp2-nccl": ([2, 2], [1, 1], "nccl"),
           "tp2": ([4], [2], "grpc")}


def per_step(model: Path, layout: str, scheduling: str, tokens: int) -> tuple[float, float]:
    """(run time, model time) per decode step of one greedy request."""
    split, tp, handoff = LAYOUTS[layout]
    with Mesh(model, split, tp=tp, handoff=handoff, scheduler_args=(f"--{scheduling}-scheduling",)) as mesh:
        mesh.generate([[5, 6, 7]], SamplingParams(max_tokens=8))  # warm-up
        before = mesh.stub.GetStats(scheduler_pb2.GetStatsRequest(), timeout=5)
        start = time.perf_counter()
        mesh.generate([[5, 6, 7]], SamplingParams(max_tokens=tokens, ignore_eos=True))
        elapsed = time.perf_counter() - start
        after = mesh.stub.GetStats(scheduler_pb2.GetStatsRequest(), timeout=5)
    steps = after.num_steps - before.num_steps
    return elapsed / steps, (after.stage_compute_seconds_total - before.stage_compute_seconds_total) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=list(LAYOUTS))
    args = parser.parse_args()
    runs: dict[tuple[str, str], list[tuple[float, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_model(Path(tmp) / "m", "llama", num_hidden_layers=4)
        for _ in range(args.rounds):
            for layout in args.layouts:
                for scheduling in ("no-async", "async"):
                    runs.setdefault((layout, scheduling), []).append(per_step(model, layout, scheduling, args.tokens))
    print(f"tiny llama (4 layers), batch 1, {args.tokens} greedy tokens, {args.rounds} round(s); ms per step, medians")
    print(f"{'layout':<9} {'scheduling':<10} {'run/step':>9} {'model/step':>11} {'OVERHEAD/step':>14}")
    for (layout, scheduling), results in runs.items():
        run = statistics.median(r[0] for r in results)
        model = statistics.median(r[1] for r in results)
        overhead = statistics.median(r[0] - r[1] for r in results)
        print(f"{layout:<9} {scheduling:<10} {run * 1e3:>9.3f} {model * 1e3:>11.3f} {overhead * 1e3:>14.3f}")


if __name__ == "__main__":
    main()
