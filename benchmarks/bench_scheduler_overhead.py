"""Scheduler + RPC overhead per step, excluding model compute, at 64 running sequences.

A real replica (scheduler and one stage process on loopback) of a tiny model, so
compute is small; the scheduler's counters give each step's wall time (Forward
sent -> reply back) and the compute the stage reported; the difference is what
the mesh adds per step. The run's duration over its steps shows as well what
happens between steps (while no micro-batch is in flight, the stage idles).
Also times the pure-Python scheduler core alone.

    .venv/bin/python benchmarks/bench_scheduler_overhead.py [--seqs 64] [--tokens 128] [--client stream|submit]
"""
from __future__ import annotations

import argparse
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
from stagemesh.sampling_params import SamplingParams  # noqa: E402
from stagemesh.step import SampledToken  # noqa: E402
from stagemesh.v1 import scheduler_pb2  # noqa: E402


def core_only(seqs: int, steps: int = 200) -> float:
    """Seconds per schedule() + update_from_output() with `seqs` decoding sequences."""
    s = Scheduler(SchedulerConfig(num_kv_blocks=100_000, max_model_len=4096, max_num_seqs=seqs))
    for i in range(seqs):
        s.add_request(f"r{i}", list(range(3, 35)), SamplingParams(max_tokens=steps + 10, ignore_eos=True))
    out = s.schedule()
    chunks = out.step_batch.chunks
    s.update_from_output(out, [SampledToken(i, 7) for i, sample in zip(chunks.seq_ids, chunks.sample) if sample])
    start = time.perf_counter()
    for _ in range(steps):
        out = s.schedule()
        s.update_from_output(out, [SampledToken(i, 7) for i in out.step_batch.chunks.seq_ids])
    return (time.perf_counter() - start) / steps


def drive(mesh: Mesh, client: str, seqs: int, sampling: SamplingParams) -> None:
    """`seqs` requests at once: over one SubmitStream (as the router sends them), or one Submit call each
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


def mesh_overhead(seqs: int, tokens: int, client: str) -> tuple[float, float, float, int]:
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_model(Path(tmp) / "m", "llama", num_hidden_layers=2)
        with Mesh(model, [2], scheduler_args=("--max-num-seqs", str(seqs))) as mesh:
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
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seqs", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--client", choices=("stream", "submit"), default="stream",
                        help="stream: every request over one multiplexed SubmitStream, as the router sends them; "
                             "submit: one Submit call per request, each from its own thread")
    args = parser.parse_args()
    core = core_only(args.seqs)
    wall, compute, interval, steps = mesh_overhead(args.seqs, args.tokens, args.client)
    print(f"{args.seqs} running sequences, {steps} steps, client: {args.client}")
    print(f"scheduler core (schedule + update), in-process : {core * 1e3:7.3f} ms/step")
    print(f"step wall time through the mesh               : {wall * 1e3:7.3f} ms/step")
    print(f"model compute reported by the stage           : {compute * 1e3:7.3f} ms/step")
    print(f"overhead (wall - compute: scheduler, RPC)     : {(wall - compute) * 1e3:7.3f} ms/step (target < 1 ms)")
    print(f"run time / steps (includes between steps)     : {interval * 1e3:7.3f} ms/step")


if __name__ == "__main__":
    main()
