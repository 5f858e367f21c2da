"""Soak: `stagemesh serve -dp 2 -pp 2` under 32 concurrent streams for 10 minutes, a poison request every
10 s and a component SIGKILLed every 2 minutes, in turn a stage, a scheduler and a whole replica (its
scheduler and stages; serve restarts them). Prints, every minute, the requests completed and failed (by
cause: a failed one is a lost request), the poison answers, the RSS of every process of the mesh, and the
stall of the streams a kill hit (each gap between two chunks of a stream that spans the moment of a kill:
p50 and max).

    .venv/bin/python benchmarks/soak.py [--duration 600] [--concurrency 32] [-dp 2] [-pp 2] [MODEL]

Only poison requests should fail (for their own input); a stream in flight when its stage, scheduler or
replica dies goes on (kept by its scheduler until the stage is back, or continued on the other replica).
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import requests
from serve_process import free_port  # noqa: E402

POISON = [
    {"temperature": 1e-45}, {"top_k": 2**31}, {"presence_penalty": 1e30}, {"stop_token_ids": [2**31]},
    {"prompt": [5, 10**7]}, {"prompt": "hi \ud800"}, {"repetition_penalty": float("nan")},
]


class Tally:
    def __init__(self):
        self.lock = threading.Lock()
        self.counts: collections.Counter = collections.Counter()

    def add(self, key: str) -> None:
        with self.lock:
            self.counts[key] += 1

    def snapshot(self) -> dict:
        with self.lock:
            return dict(self.counts)


def stream_once(base: str, model: str, rng: random.Random, max_tokens: int, stalls: list) -> str:
    body = {"model": model, "prompt": " ".join(rng.choice(["the", "a", "cat", "sat", "on", "mat", "and", "then"])
                                               for _ in range(rng.randint(8, 64))),
            "max_tokens": max_tokens, "temperature": 0.8, "seed": rng.randrange(1 << 30), "stream": True}
    try:
        with requests.post(f"{base}/v1/completions", json=body, stream=True, timeout=300) as resp:
            if resp.status_code in (429, 503):  # no replica can take it now: wait as told, as clients do
                time.sleep(float(resp.headers.get("Retry-After", 1)))
                return f"refused {resp.status_code} (retried after Retry-After)"
            if resp.status_code != 200:
                return f"failed {resp.status_code}"
            last, gaps = time.monotonic(), []
            for line in resp.iter_lines():
                if line.startswith(b"data: {") and b'"error"' in line:
                    return "failed in stream: " + json.loads(line[6:])["error"]["type"]
                now = time.monotonic()
                gaps.append((last, now))
                last = now
            stalls.append(gaps)
            return "completed"
    except requests.RequestException as err:
        return f"failed {type(err).__name__}"


def rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def children(log: Path) -> dict[str, int]:
    """The latest pid of every child serve started."""
    return {name: int(pid) for name, pid in re.findall(r"started (\S+) \(pid (\d+)\)", log.read_text())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", default=None)
    p.add_argument("--duration", type=float, default=600)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("-pp", "--pipeline-parallel-size", type=int, default=2)
    p.add_argument("-dp", "--data-parallel-size", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--poison-every", type=float, default=10)
    p.add_argument("--kill-every", type=float, default=120)
    args = p.parse_args()
    port, log = free_port(), Path(tempfile.mkdtemp(prefix="stagemesh-soak-")) / "serve.log"
    argv = [sys.executable, "-m", "stagemesh", "serve", *([args.model] if args.model else []), "-pp",
            str(args.pipeline_parallel_size), "-dp", str(args.data_parallel_size), "--port", str(port),
            "--grpc-port", str(free_port())]
    serve = subprocess.Popen(argv, stdout=open(log, "wb"), stderr=subprocess.STDOUT)
    base, stop = f"http://127.0.0.1:{port}", threading.Event()
    tally, poison, kills, stalls = Tally(), Tally(), [], []
    try:
        model = wait_ready(base, serve, log)
        print(f"serving {model}; log {log}", flush=True)

        def client(i: int) -> None:
            rng = random.Random(i)
            while not stop.is_set():
                tally.add(stream_once(base, model, rng, args.max_tokens, stalls))

        def poisoner() -> None:
            n = 0
            while not stop.wait(args.poison_every):
                body = {"model": model, "prompt": "poison", "max_tokens": 4, **POISON[n % len(POISON)]}
                n += 1
                try:
                    status = requests.post(f"{base}/v1/completions", data=json.dumps(body), timeout=60,
                                           headers={"Content-Type": "application/json"}).status_code
                except requests.RequestException as err:
                    status = type(err).__name__
                poison.add(str(status))

        def killer() -> None:
            pp, dp, n = args.pipeline_parallel_size, args.data_parallel_size, 0
            while not stop.wait(args.kill_every):
                replica = n % dp
                kind = ("stage", "scheduler", "replica")[n % 3]
                n += 1
                names = {"stage": [f"stage[{replica}.{n % pp}]"], "scheduler": [f"scheduler[{replica}]"],
                         "replica": [f"scheduler[{replica}]", *(f"stage[{replica}.{i}]" for i in range(pp))]}[kind]
                pids = children(log)
                for name in names:
                    if name in pids:
                        os.kill(pids[name], signal.SIGKILL)
                kills.append((time.monotonic(), kind))
                print(f"  SIGKILL {kind}: {', '.join(names)}", flush=True)

        downtimes: list[float] = []

        def watch_health() -> None:  # how long the mesh is not ready (/ready 503) after each kill
            down_since = None
            while not stop.wait(0.5):
                try:
                    up = requests.get(f"{base}/ready", timeout=2).status_code == 200
                except requests.RequestException:
                    up = False
                if not up and down_since is None:
                    down_since = time.monotonic()
                elif up and down_since is not None:
                    downtimes.append(time.monotonic() - down_since)
                    down_since = None

        threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(args.concurrency)]
        threads += [threading.Thread(target=f, daemon=True) for f in (poisoner, killer, watch_health)]
        start = time.monotonic()
        for t in threads:
            t.start()
        while time.monotonic() - start < args.duration:
            time.sleep(min(60, args.duration - (time.monotonic() - start)))
            report(time.monotonic() - start, tally, poison, kills, log, downtimes, stalls)
        stop.set()
    finally:
        serve.send_signal(signal.SIGTERM)
        serve.wait(timeout=60)


def wait_ready(base: str, serve: subprocess.Popen, log: Path) -> str:
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if serve.poll() is not None:
            sys.exit(f"serve exited:\n{log.read_text()[-3000:]}")
        try:
            if requests.get(f"{base}/ready", timeout=2).status_code == 200:
                return requests.get(f"{base}/v1/models", timeout=5).json()["data"][0]["id"]
        except requests.RequestException:
            pass
        time.sleep(1)
    sys.exit("the mesh did not become healthy in 10 minutes")


def report(elapsed: float, tally: Tally, poison: Tally, kills: list, log: Path, downtimes: list, stalls: list) -> None:
    counts = tally.snapshot()
    done = counts.get("completed", 0)
    failed = {k: v for k, v in counts.items() if k.startswith("failed")}
    refused = sum(v for k, v in counts.items() if k.startswith("refused"))
    rss = {name: rss_mb(pid) for name, pid in children(log).items()}
    restarts = len(re.findall(r"restarting it", log.read_text()))
    times = [t for t, _ in kills]
    stalled = sorted(end - start for gaps in list(stalls) for start, end in gaps
                     if any(start <= t <= end for t in times))
    stall = f"p50 {stalled[len(stalled) // 2]:.1f}s, max {stalled[-1]:.1f}s" if stalled else "-"
    print(f"[{elapsed / 60:4.1f} min] completed {done}, lost {sum(failed.values())} {failed or ''}, refused while "
          f"down {refused}; poison answers {poison.snapshot()}; killed {[k for _, k in kills]}, restarts {restarts}; "
          f"router down (s): {[round(d, 1) for d in downtimes]}; streams stalled by a kill: {len(stalled)} ({stall})",
          flush=True)
    print("  RSS MB: " + ", ".join(f"{n} {v:.0f}" for n, v in rss.items() if v is not None), flush=True)


if __name__ == "__main__":
    main()
