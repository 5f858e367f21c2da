"""Where a decode step's time goes in the mesh (CPU): scheduler, RPC, handoff, model.

A real PP=2 replica of the default model (scheduler + two stage processes on loopback,
--threads torch threads each, GOMP_SPINCOUNT as `stagemesh serve` sets it, nccl handoff =
gloo on CPU). For batch 1 and 32 it runs greedy decodes and reads, per micro-batch step:
the scheduler's step wall time (Forward sent -> reply handled, from Stats) and each stage's
Prometheus histograms (time in its Forward handler, model compute, waiting for the previous
stage's activations). Derived:

  scheduler + RPC = step wall - last stage's Forward time (transit both ways + the scheduler's work)
  queue + books   = a stage's Forward time - its compute - its handoff wait: decoding the step and
                    encoding the reply, plus (batch 32: two micro-batches in flight) waiting for the
                    stage to finish the other micro-batch
  handoff         = last stage's handoff wait - first stage's compute (the transfer; batch 1 only)
  run/step        = the run's time over its steps (what a token costs at batch 1)

The breakdown reads the synchronous path, so the scheduler runs with --no-async-scheduling unless
--async-scheduling is given (then steps wait on the stages behind the step ahead, and only s0 model,
s1 model and run/step keep their meaning; s0 wait is then its wait for the last stage's tokens).

    .venv/bin/python benchmarks/profile_mesh_step.py [--batch 1 32] [--tokens 64] [--threads N]
        [--async-scheduling] [--log-dir D]
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))

from mesh import Mesh, free_port  # noqa: E402

from stagemesh.core.default_model import default_model_dir  # noqa: E402
from stagemesh.entry.serve import cpu_stage_env  # noqa: E402
from stagemesh.core.sampling_params import SamplingParams  # noqa: E402
from stagemesh.v1 import scheduler_pb2  # noqa: E402

SERIES = {"forward": "stagemesh:stage_forward_seconds", "compute": "stagemesh:stage_compute_seconds",
          "wait": "stagemesh:stage_handoff_wait_seconds"}


def scrape(port: int) -> dict[str, float]:
    """Sum of each histogram of one stage (its only label is the stage)."""
    text = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    sums = {}
    for name, metric in SERIES.items():
        line = next(x for x in text.splitlines() if x.startswith(f"{metric}_sum"))
        sums[name] = float(line.rsplit(" ", 1)[1])
    return sums


def profile(mesh: Mesh, ports: list[int], batch: int, tokens: int) -> dict[str, float]:
    rng = random.Random(batch)
    prompts = [[rng.randrange(100, 40000) for _ in range(16)] for _ in range(batch)]
    before = [scrape(p) for p in ports], mesh.stub.GetStats(scheduler_pb2.GetStatsRequest(), timeout=5)
    start = time.perf_counter()
    mesh.generate(prompts, SamplingParams(max_tokens=tokens, ignore_eos=True))
    elapsed = time.perf_counter() - start
    after = [scrape(p) for p in ports], mesh.stub.GetStats(scheduler_pb2.GetStatsRequest(), timeout=5)
    steps = after[1].num_steps - before[1].num_steps
    per_step = {"wall": (after[1].step_seconds_total - before[1].step_seconds_total) / steps,
                "run": elapsed / steps}
    for i in range(len(ports)):
        for name in SERIES:
            per_step[f"{name}{i}"] = (after[0][i][name] - before[0][i][name]) / steps
    per_step["steps"] = steps
    return per_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per stage process")
    parser.add_argument("--log-dir", type=Path, default=None, help="keep each process's log here")
    parser.add_argument("--async-scheduling", action="store_true", help="as `serve` runs (see above)")
    args = parser.parse_args()
    os.environ.update(cpu_stage_env())  # as `stagemesh serve` sets it for its stages
    ports = [free_port(), free_port()]
    per_stage = {i: ["--metrics-port", str(p)] for i, p in enumerate(ports)}
    with Mesh(default_model_dir(), [15, 15], handoff="nccl", per_stage_args=per_stage,
              stage_args=("--threads", str(args.threads)), log_dir=args.log_dir,
              scheduler_args=() if args.async_scheduling else ("--no-async-scheduling",)) as mesh:
        mesh.generate([[5, 6, 7]], SamplingParams(max_tokens=4))  # warm-up
        print(f"default model, PP=2 (15+15 layers), {args.threads} thread(s) per stage, {args.tokens} greedy tokens "
              f"per request, {'async' if args.async_scheduling else 'synchronous'} scheduling; ms per micro-batch step")
        print(f"{'batch':>5} {'steps':>5} {'wall':>7} | {'s0 model':>8} {'s0 queue+books':>14} | {'s1 wait':>7} "
              f"{'s1 model':>8} {'s1 queue+books':>14} | {'handoff':>7} {'sched+RPC':>9} | {'run/step':>8}")
        for batch in args.batch:
            p = profile(mesh, ports, batch, args.tokens)
            ms = {k: v * 1e3 for k, v in p.items() if k != "steps"}
            books0 = ms["forward0"] - ms["compute0"] - ms["wait0"]
            books1 = ms["forward1"] - ms["compute1"] - ms["wait1"]
            handoff = ms["wait1"] - ms["compute0"] if batch == 1 else float("nan")
            print(f"{batch:>5} {p['steps']:>5} {ms['wall']:>7.1f} | {ms['compute0']:>8.1f} {books0:>14.2f} | "
                  f"{ms['wait1']:>7.1f} {ms['compute1']:>8.1f} {books1:>14.2f} | {handoff:>7.2f} "
                  f"{ms['wall'] - ms['forward1']:>9.2f} | {ms['run']:>8.1f}")


if __name__ == "__main__":
    main()
