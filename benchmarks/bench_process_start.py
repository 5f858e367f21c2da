"""What a process of the mesh costs to start: `stagemesh serve` under each start method
(STAGEMESH_WORKER_MULTIPROC_METHOD: spawn, forkserver), alternating, --rounds times. Each start waits for /health
to say 200, then reads from /proc the CPU (utime + stime) of every process under serve: serve itself, each child by
the name serve's log gives it (`started stage[0] (pid N)`), each stage's TP followers, and the fork servers. Prints
the seconds to 200 and each role's CPU-seconds, as medians over the rounds, with the machine's ISA.

    .venv/bin/python benchmarks/bench_process_start.py [--rounds 3] [--tp 3] [--methods spawn,forkserver]

The meshes start as the tests start theirs: without the warm-up, one thread a stage (--threads 1).
"""
from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import requests

from bench_kv_tiers_restart import isa
from serve_process import free_port

CLK = os.sysconf("SC_CLK_TCK")


def _stat(pid: int) -> tuple[int, float]:
    """(parent pid, CPU-seconds of the process itself)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / CLK


def _tree(root: int) -> dict[int, tuple[int, float]]:
    procs = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                procs[int(entry)] = _stat(int(entry))
            except (OSError, IndexError, ValueError):
                pass
    keep, todo = {}, [root]
    while todo:
        pid = todo.pop()
        keep[pid] = procs[pid]
        todo += [p for p, (parent, _) in procs.items() if parent == pid]
    return keep


def one_start(method: str, tp: int) -> tuple[float, dict[str, float]]:
    port, log = free_port(), Path(tempfile.mkdtemp()) / "serve.log"
    env = {**os.environ, "STAGEMESH_WORKER_MULTIPROC_METHOD": method, "STAGEMESH_SKIP_SERVER_WARMUP": "1",
           "OMP_NUM_THREADS": "1"}
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "stagemesh", "serve", "--port", str(port), "--threads", "1",
                             "--tensor-parallel-size", str(tp)], stdout=open(log, "wb"), stderr=subprocess.STDOUT,
                            env=env, start_new_session=True)
    try:
        while True:
            if proc.poll() is not None or time.monotonic() - t0 > 300:
                raise SystemExit(f"serve did not answer /health:\n{log.read_text()[-3000:]}")
            try:
                if requests.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except requests.RequestException:
                pass
            time.sleep(0.05)
        ready = time.monotonic() - t0
        tree = _tree(proc.pid)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)
    names = {int(pid): name for name, pid in re.findall(r"started (\S+) \(pid (\d+)\)", log.read_text())}
    cpu: dict[str, float] = defaultdict(float)
    for pid, (parent, seconds) in tree.items():
        if pid == proc.pid:
            role = "serve"
        elif pid in names:
            role = re.sub(r"\[[\d.]+\]", "", names[pid])
        elif names.get(parent, "").startswith("stage"):
            role = "tp follower"
        else:
            role = "fork server"
        cpu[role] += seconds
    return ready, cpu


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tp", type=int, default=3, help="the stage's -tp (3 divides the default model's 9 heads)")
    p.add_argument("--methods", default="spawn,forkserver")
    args = p.parse_args()
    methods = args.methods.split(",")
    runs: dict[str, list] = {m: [] for m in methods}
    for _ in range(args.rounds):
        for m in methods:  # alternating: a shared machine's drift falls on both
            runs[m].append(one_start(m, args.tp))
    print(f"machine: {isa()}; serve -tp {args.tp}, the default model, {args.rounds} round(s), medians")
    for m in methods:
        roles = sorted({r for _, cpu in runs[m] for r in cpu})
        parts = [f"{r} {statistics.median(cpu.get(r, 0.0) for _, cpu in runs[m]):.2f}" for r in roles]
        total = statistics.median(sum(cpu.values()) for _, cpu in runs[m])
        ready = statistics.median(t for t, _ in runs[m])
        print(f"{m:10s} /health 200 in {ready:5.2f} s; CPU-s: total {total:.2f}; " + ", ".join(parts))


if __name__ == "__main__":
    main()
