"""Scheduler + RPC overhead per step, excluding model compute, at 64 running sequences.

A real replica (scheduler and one stage process on loopback) of a tiny model, so
compute is small. The figure is what each step costs beyond the model: the run's
duration over its steps, less the compute the stage reported per step, i.e. how
long the stage waits per step for the scheduler and the RPCs. Measured with async
scheduling (the default at one stage: the next step is on the stage before the
current one ends) and without it (the scheduler waits for each step's tokens
before it schedules the next), alternating, in the same run. Also prints each
step's latency (Forward sent -> reply back; with async scheduling it includes
the wait behind the step ahead) and times the pure-Python scheduler core alone.

    .venv/bin/python benchmarks/bench_scheduler_overhead.py [--seqs 64] [--tokens 128] [--rounds 2]
        [--client stream|submit]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))

from mesh import Mesh  # noqa: E402
from tiny_models import make_tiny_model  # noqa: E402

from scheduler.config import SchedulerConfig  # noqa: E402
from scheduler.scheduler import Scheduler  # noqa: E402
from stagemesh.core.engine_request import EngineRequest  # noqa: E402
from stagemesh.core.sampling_params import SamplingParams  # noqa: E402
from stagemesh.core.step import SampledToken  # noqa: E402
from stagemesh.v1 import scheduler_pb2  # noqa: E402


def core_only(seqs: int, steps: int = 200) -> float:
    """Seconds per schedule() + update_from_output() with `seqs` decoding sequences."""
    s = Scheduler(SchedulerConfig(num_kv_blocks=100_000, max_model_len=4096, max_num_seqs=seqs))
    for i in range(seqs):
        sampling = SamplingParams(max_tokens=steps + 10, ignore_eos=True)
        s.add_request(EngineRequest(f"r{i}", list(range(3, 35)), sampling))
    out = s.schedule()
    chunks = out.step_batch.chunks
    s.update_from_output(out, [SampledToken(i, 7) for i, sample in zip(chunks.seq_ids, chunks.sample) if sample])
    start = time.perf_counter()
    for _ in range(steps):
        out = s.schedule()
        s.update_from_output(out, [SampledToken(i, 7) for i in out.step_batch.chunks.seq_ids])
    return (time.perf_counter() - start) / steps


def drive(mesh: Mesh, client: str, seqs: int, sampling: SamplingParams) -> None:
    """`seqs` requests at once: over one SubmitStream (as the router sends them), or a SubmitStream each
    from a thread of its own (those threads cost the client several ms of CPU per step)."""
    requests = [(f"b{i}", [5 + i % 300, 6, 7], sampling) for i in range(seqs)]
    if client == "stream":
        results = mesh.submit_stream(requests)
        failed = [r for r in results.values() if not isinstance(r, tuple)]
        if failed:
            raise RuntimeError(f"{len(failed)} request(s) failed: {failed[0]}")
        return
    with ThreadPoolExecutor(seqs) as pool:
        list(pool.map(lambda r: mesh.submit(*r), requests))


def mesh_overhead(model: Path, seqs: int, tokens: int, client: str, async_scheduling: bool
                  ) -> tuple[float, float, float, int]:
    flag = "--async-scheduling" if async_scheduling else "--no-async-scheduling"
    with Mesh(model, [2], scheduler_args=("--max-num-seqs", str(seqs), flag)) as mesh:
        sampling = SamplingParams(max_tokens=tokens, ignore_eos=True)
        mesh.generate([[5, 6, 7]], SamplingParams(max_tokens=4))  # warm-up
        before = mesh.stub.GetStats(scheduler_pb2.GetStatsRequest(), timeout=5)
        start = time.perf_counter()
        drive(mesh, client, seqs, sampling)
        elapsed = time.perf_counter() - start
        after = mesh.stub.GetStats(scheduler_pb2.GetStatsRequest(), timeout=5)
    steps = after.num_steps - before.num_steps
    wall = (after.step_seconds_total - before.step_seconds_total) / steps
    compute = (after.stage_compute_seconds_total - before.stage_compute_seconds_total) / steps
    return wall, compute, elapsed / steps, steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2, help="runs of each mode, alternating; medians are printed")
    parser.add_argument("--client", choices=("stream", "submit"), default="stream",
                        help="stream: every request over one multiplexed SubmitStream, as the router sends them; "
                             "submit: a SubmitStream per request, each from its own thread")
    args = parser.parse_args()
    core = core_only(args.seqs)
    print(f"{args.seqs} running sequences, {args.tokens} tokens each, client: {args.client}, {args.rounds} round(s)")
    print(f"scheduler core (schedule + update), in-process: {core * 1e3:.3f} ms/step")
    runs: dict[str, list[tuple[float, float, float, int]]] = {"sync": [], "async": []}
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_model(Path(tmp) / "m", "llama", num_hidden_layers=2)
        for _ in range(args.rounds):
            for mode in runs:
                runs[mode].append(mesh_overhead(model, args.seqs, args.tokens, args.client, mode == "async"))
    print(f"{'scheduling':<10} {'steps':>6} {'run time/step':>14} {'compute/step':>13} {'OVERHEAD/step':>14} "
          f"{'step latency':>13}  (ms, medians)")
    overhead = {}
    for mode, results in runs.items():
        wall, compute, interval = (statistics.median(r[i] for r in results) for i in range(3))
        overhead[mode] = statistics.median(r[2] - r[1] for r in results)
        print(f"{mode:<10} {results[0][3]:>6} {interval * 1e3:>14.3f} {compute * 1e3:>13.3f} "
              f"{overhead[mode] * 1e3:>14.3f} {wall * 1e3:>13.3f}")
    print(f"overhead per step (run time/step - compute/step), async scheduling: {overhead['async'] * 1e3:.3f} ms "
          f"(target < 1 ms); without: {overhead['sync'] * 1e3:.3f} ms")


if __name__ == "__main__":
    main()
