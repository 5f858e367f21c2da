"""Pipeline efficiency on this machine's cores: PP=2 with each stage pinned to one core
against PP=1 on one core, 32 concurrent sequences of the default model. Same run.

Also prints the ratio a perfect pipeline would reach here (no bubbles, no scheduler): PP=2
runs each stage on half the sequences (two micro-batches), and a 16-row decode step of a
stage's layers costs more than half a 32-row one (its weights are read once per step);
measured in-process on one thread with the same split.

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

from stagemesh.core.default_model import default_model_dir  # noqa: E402
from stagemesh.core.engine_request import EngineRequest  # noqa: E402
from stagemesh.core.sampling_params import SamplingParams  # noqa: E402


def throughput(split: list[int], cores: list[str], prompts, tokens: int, handoff: str) -> float:
    model = default_model_dir()
    pins = {i: ["--cpu-affinity", core] for i, core in enumerate(cores)}
    with Mesh(model, split, handoff=handoff, per_stage_args=pins) as mesh:
        mesh.generate(prompts[:2], SamplingParams(max_tokens=4))  # warm-up
        start = time.perf_counter()
        out = mesh.generate(prompts, SamplingParams(max_tokens=tokens, ignore_eos=True))
        elapsed = time.perf_counter() - start
    return sum(len(o) for o in out) / elapsed


def stage_step_seconds(split: list[int], batch: int, prompt: int, steps: int = 8) -> list[float]:
    """Median decode-step time of each stage of `split` at `batch` sequences, in-process, one thread."""
    import statistics

    import torch

    from scheduler.config import SchedulerConfig
    from scheduler.scheduler import Scheduler
    from stage_worker.runner import StageRunner
    from stagemesh.core.model_config import layer_ranges

    torch.set_num_threads(1)
    runners = [StageRunner.of(default_model_dir(), a, b) for a, b in layer_ranges(split)]
    num_blocks = batch * -(-(prompt + steps + 4) // runners[0].block_size) + 8
    for runner in runners:
        runner.allocate_kv_cache(num_blocks)
    scheduler = Scheduler(SchedulerConfig(num_kv_blocks=num_blocks, max_model_len=prompt + steps + 4))
    rng = random.Random(batch)
    for i in range(batch):
        scheduler.add_request(EngineRequest(f"r{i}", [rng.randrange(100, 40000) for _ in range(prompt)],
                                            SamplingParams(max_tokens=steps + 4, ignore_eos=True)))
    times: list[list[float]] = [[] for _ in split]
    for step in range(steps + 2):
        output = scheduler.schedule()
        hidden, result = None, None
        for i, runner in enumerate(runners):
            start = time.perf_counter()
            result = runner.execute(output.step_batch, hidden)
            if step >= 2:  # the prefill and the first decode step are not decode-step figures
                times[i].append(time.perf_counter() - start)
            hidden = result.hidden_states
        scheduler.update_from_output(output, result.sampled)
    return [statistics.median(t) for t in times]


def ideal_ratio(split: list[int], seqs: int, prompt: int) -> float:
    """PP=1 does a round of `seqs` tokens in one step of all layers; PP=2 in two micro-batches of
    half the sequences, each stage busy 2 x its half-batch time, the slower stage setting the pace."""
    full = stage_step_seconds(split, seqs, prompt)
    half = stage_step_seconds(split, seqs // 2, prompt)
    return sum(full) / (2 * max(half))


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
    print(f"ratio               : {two / one:7.2f}x")
    split = [int(x) for x in args.layer_split.split(",")]
    ideal = ideal_ratio(split, args.seqs, args.prompt)
    print(f"a perfect pipeline  : {ideal:7.2f}x (decode steps of each stage at {args.seqs // 2} vs {args.seqs} rows, "
          "in-process)")
    print(f"of a perfect one    : {two / one / ideal:7.2f} (target >= 0.9)")


if __name__ == "__main__":
    main()
