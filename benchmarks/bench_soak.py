"""Memory soak: `stagemesh serve -pp 2` of the default model under 24 client loops of mixed requests
(completions and chat; max_tokens 16-256; temperatures 0-1.3; JSON schema, JSON object, regex and choice
constraints; n=2; logprobs; streamed and not) for a given time, sampling the memory of every process of
the mesh (serve, router, scheduler, each stage, and any process under them) every minute.

    .venv/bin/python benchmarks/bench_soak.py [--minutes 60] [--warmup-minutes 10] [--concurrency 24]
        [--interval 60] [--out soak.json] [-pp 2] [MODEL] [-- EXTRA SERVE FLAGS]

Each sample holds RSS, and USS and PSS (from /proc/PID/smaps_rollup) of each process. At the end it prints,
per process, the least-squares slope of each in MiB/min over the samples after the warm-up, the requests
completed and the errors by cause, and writes the samples as JSON (with the slopes and counts) and as CSV
beside it. Target (issue 43): after a 10-minute warm-up every slope under 0.5 MiB/min and no error.

The processes are found from serve's process tree (psutil) and named from serve's log (`started
stage[0.1] (pid N)`), again at every sample, so a restarted process shows (its pid changes; the restart is
counted). SIGINT or SIGTERM stops the clients, then serve (SIGTERM to its process group, SIGKILL if it does
not exit in 120 s), and still writes what was sampled; serve also gets SIGTERM if this script dies otherwise.
"""
from __future__ import annotations

import argparse
import collections
import csv
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

import psutil
import requests

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_process import free_port  # noqa: E402

WORDS = ("the a cat sat on mat and then we go to city river blue green fast slow story about old ship "
         "robot who learned paint describe weather today list three colors name animal").split()
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "tags": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                                    "maxItems": 4}},
          "required": ["name", "age"]}
REGEXES = [r"[A-Z][a-z]{2,12}( [a-z]{1,10}){0,6}\.", r"\d{3}-\d{3}-\d{4}", r"(yes|no|maybe), because [a-z ]{4,60}"]
CHOICES = [["red", "green", "blue"], ["positive", "negative", "neutral"], ["cat", "dog", "horse", "bird"]]
MIB = 1 << 20


class Tally:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.counts: collections.Counter = collections.Counter()

    def add(self, key: str) -> None:
        with self.lock:
            self.counts[key] += 1

    def snapshot(self) -> dict[str, int]:
        with self.lock:
            return dict(self.counts)


def prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 96)))


def make_request(rng: random.Random, model: str) -> tuple[str, str, dict]:
    """(kind, path, body) of one mixed request."""
    kind = rng.choice(["completion", "completion_stream", "completion_n2", "completion_logprobs", "chat",
                       "chat_stream", "json_schema", "json_object", "regex", "choice", "chat_n2_stream"])
    temperature = rng.choice([0.0, 0.5, 0.8, 1.0, 1.3])
    common = {"model": model, "max_tokens": rng.randint(16, 256), "temperature": temperature,
              "seed": rng.randrange(1 << 30)}
    if rng.random() < 0.3:
        common["top_p"] = rng.choice([0.8, 0.95])
    if kind.startswith("completion"):
        body = {**common, "prompt": prompt(rng)}
        if kind == "completion_stream":
            body["stream"] = True
        elif kind == "completion_n2":
            body["n"] = 2
        elif kind == "completion_logprobs":
            body["logprobs"] = rng.choice([1, 5])
        return kind, "/v1/completions", body
    body = {**common, "messages": [{"role": "user", "content": prompt(rng)}]}
    if kind == "chat_stream":
        body["stream"] = True
    elif kind == "chat_n2_stream":
        body.update(n=2, stream=True)
    elif kind == "json_schema":
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    elif kind == "json_object":
        body["response_format"] = {"type": "json_object"}
    elif kind == "regex":
        body["structured_outputs"] = {"regex": rng.choice(REGEXES)}
    elif kind == "choice":
        body["structured_outputs"] = {"choice": rng.choice(CHOICES)}
    return kind, "/v1/chat/completions", body


def send(base: str, path: str, body: dict) -> str:
    """'ok', or why it failed."""
    try:
        if body.get("stream"):
            with requests.post(base + path, json=body, stream=True, timeout=600) as resp:
                if resp.status_code != 200:
                    return f"http {resp.status_code}"
                done = False
                for line in resp.iter_lines():
                    if line.startswith(b"data: {") and b'"error"' in line[:40]:
                        return "in stream: " + str(json.loads(line[6:]).get("error", {}).get("type"))
                    if line == b"data: [DONE]":
                        done = True
                return "ok" if done else "stream ended without [DONE]"
        resp = requests.post(base + path, json=body, timeout=600)
        if resp.status_code != 200:
            return f"http {resp.status_code}"
        if not resp.json().get("choices"):
            return "no choices"
        return "ok"
    except requests.RequestException as err:
        return type(err).__name__


def memory(pid: int) -> dict[str, float] | None:
    """RSS, USS and PSS of a process in MiB (USS = private clean + private dirty; from smaps_rollup)."""
    try:
        rss = psutil.Process(pid).memory_info().rss / MIB
        fields: dict[str, int] = {}
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            parts = line.split()
            if len(parts) == 3 and parts[2] == "kB":
                fields[parts[0].rstrip(":")] = int(parts[1])
        uss = (fields.get("Private_Clean", 0) + fields.get("Private_Dirty", 0)) / 1024
        return {"rss": rss, "uss": uss, "pss": fields.get("Pss", 0) / 1024}
    except (psutil.Error, OSError):
        return None


def processes(serve: subprocess.Popen, log: Path) -> dict[str, int]:
    """{name: pid} of serve and every process under it: serve's children by the names its log gives them
    (router, scheduler[0], stage[0.1], ...), their children as `<parent>/<command>#<n>`."""
    logged = {int(pid): name for name, pid in re.findall(r"started (\S+) \(pid (\d+)\)", log.read_text())}
    found = {"serve": serve.pid}
    try:
        top = psutil.Process(serve.pid)
        for child in top.children():
            name = logged.get(child.pid, f"pid{child.pid}")
            found[name] = child.pid
            for i, grandchild in enumerate(child.children(recursive=True)):
                try:
                    cmd = os.path.basename(grandchild.cmdline()[0]) if grandchild.cmdline() else "?"
                except psutil.Error:
                    cmd = "?"
                found[f"{name}/{cmd}#{i}"] = grandchild.pid
    except psutil.Error:
        pass
    return found


def slope(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of (minute, MiB) points: MiB/min."""
    if len(points) < 2:
        return None
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    return sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else None


def wait_ready(base: str, serve: subprocess.Popen, log: Path, timeout: float = 900) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if serve.poll() is not None:
            raise SystemExit(f"serve exited:\n{log.read_text()[-3000:]}")
        try:
            if requests.get(f"{base}/ready", timeout=2).status_code == 200:
                return requests.get(f"{base}/v1/models", timeout=5).json()["data"][0]["id"]
        except (requests.RequestException, ValueError, KeyError, IndexError):
            pass
        time.sleep(1)
    raise SystemExit(f"the mesh was not ready in {timeout:.0f} s:\n{log.read_text()[-3000:]}")


def stop_serve(serve: subprocess.Popen) -> None:
    if serve.poll() is None:
        try:
            os.killpg(serve.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            serve.wait(timeout=120)
        except subprocess.TimeoutExpired:
            kill_tree(serve.pid)
            serve.wait(timeout=30)


def kill_tree(pid: int) -> None:
    """SIGKILL serve and every process under it (the children run in process groups of their own)."""
    try:
        procs = psutil.Process(pid).children(recursive=True) + [psutil.Process(pid)]
    except psutil.Error:
        return
    for proc in procs:
        try:
            proc.kill()
        except psutil.Error:
            pass


def summarise(samples: list[dict], warmup: float) -> dict[str, dict[str, float | None]]:
    """{process: {rss/uss/pss slope MiB/min after the warm-up, first and last value}}."""
    names = sorted({name for s in samples for name in s["procs"]})
    out: dict[str, dict[str, float | None]] = {}
    for name in names:
        row: dict[str, float | None] = {}
        pid_seen = {s["procs"][name]["pid"] for s in samples if name in s["procs"]}
        row["pids"] = len(pid_seen)
        for metric in ("rss", "uss", "pss"):
            pts = [(s["minute"], s["procs"][name][metric]) for s in samples
                   if name in s["procs"] and s["minute"] >= warmup]
            row[f"{metric}_slope"] = slope(pts)
            row[f"{metric}_after_warmup"] = pts[0][1] if pts else None
            row[f"{metric}_last"] = pts[-1][1] if pts else None
        out[name] = row
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", default=None)
    p.add_argument("--minutes", type=float, default=60)
    p.add_argument("--warmup-minutes", type=float, default=10)
    p.add_argument("--interval", type=float, default=60, help="seconds between memory samples")
    p.add_argument("--concurrency", type=int, default=24)
    p.add_argument("-pp", "--pipeline-parallel-size", type=int, default=2)
    p.add_argument("--out", type=Path, default=None, help="JSON of the samples (CSV beside it); default in a temp dir")
    p.add_argument("--seed", type=int, default=0)
    args, extra = p.parse_known_args()
    extra = [a for a in extra if a != "--"]
    workdir = Path(tempfile.mkdtemp(prefix="stagemesh-bench-soak-"))
    out = args.out or workdir / "soak.json"
    log = workdir / "serve.log"
    port = free_port()
    argv = [sys.executable, "-m", "stagemesh", "serve", *([args.model] if args.model else []), "-pp",
            str(args.pipeline_parallel_size), "--port", str(port), "--grpc-port", str(free_port()), *extra]

    def on_signal(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, on_signal)
    # serve dies with this script even if it is SIGKILLed (stagemesh.entry.supervisor.die_with_parent: PR_SET_PDEATHSIG)
    env = {**os.environ, "STAGEMESH_SUPERVISOR_PID": str(os.getpid())}
    serve = subprocess.Popen(argv, stdout=open(log, "wb"), stderr=subprocess.STDOUT, start_new_session=True, env=env)
    base, stop = f"http://127.0.0.1:{port}", threading.Event()
    tally, kinds = Tally(), Tally()
    samples: list[dict] = []
    start = time.monotonic()
    try:
        model = wait_ready(base, serve, log)
        print(f"serving {model} (pid {serve.pid}); log {log}; samples {out}", flush=True)

        def client(i: int) -> None:
            rng = random.Random(args.seed * 1000 + i)
            while not stop.is_set():
                kind, path, body = make_request(rng, model)
                result = send(base, path, body)
                if not stop.is_set():  # a request cut by the end of the run is not an error
                    tally.add(result)
                    kinds.add(kind)

        threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(args.concurrency)]
        start = time.monotonic()
        for t in threads:
            t.start()
        next_sample = start
        while True:
            now = time.monotonic()
            if now >= next_sample:
                sample(samples, serve, log, start, tally)
                next_sample += args.interval
            if now - start >= args.minutes * 60:
                break
            time.sleep(max(0.0, min(next_sample, start + args.minutes * 60) - time.monotonic()))
        stop.set()
    except KeyboardInterrupt as why:
        print(f"stopped ({str(why) or 'SIGINT'}) after {(time.monotonic() - start) / 60:.1f} min", flush=True)
    finally:
        stop.set()
        stop_serve(serve)
        write(out, samples, args, tally, kinds, log)


def sample(samples: list[dict], serve: subprocess.Popen, log: Path, start: float, tally: Tally) -> None:
    minute = (time.monotonic() - start) / 60
    procs = {}
    for name, pid in processes(serve, log).items():
        mem = memory(pid)
        if mem is not None:
            procs[name] = {"pid": pid, **mem}
    counts = tally.snapshot()
    load = os.getloadavg()
    samples.append({"minute": round(minute, 3), "time": time.time(), "loadavg": load, "counts": counts,
                    "procs": procs})
    errors = sum(v for k, v in counts.items() if k != "ok")
    print(f"[{minute:5.1f} min] ok {counts.get('ok', 0)}, errors {errors}, load {load[0]:.1f}; RSS/USS MiB: "
          + ", ".join(f"{n} {m['rss']:.0f}/{m['uss']:.0f}" for n, m in procs.items()), flush=True)


def write(out: Path, samples: list[dict], args: argparse.Namespace, tally: Tally, kinds: Tally, log: Path) -> None:
    if not samples:
        return
    summary = summarise(samples, args.warmup_minutes)
    counts = tally.snapshot()
    errors = {k: v for k, v in counts.items() if k != "ok"}
    loads = [s["loadavg"][0] for s in samples]
    restarts = len(re.findall(r"restarting it", log.read_text())) if log.exists() else 0
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                               "counts": counts, "kinds": kinds.snapshot(), "restarts": restarts,
                               "slopes_mib_per_min": summary, "samples": samples}, indent=1))
    with open(out.with_suffix(".csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["minute", "process", "pid", "rss_mib", "uss_mib", "pss_mib", "loadavg1"])
        for s in samples:
            for name, m in s["procs"].items():
                w.writerow([s["minute"], name, m["pid"], f"{m['rss']:.2f}", f"{m['uss']:.2f}", f"{m['pss']:.2f}",
                            f"{s['loadavg'][0]:.2f}"])
    print(f"\nrequests ok {counts.get('ok', 0)}, errors {sum(errors.values())} {errors or ''}; restarts {restarts}; "
          f"kinds {kinds.snapshot()}; load average 1-min mean {sum(loads) / len(loads):.1f} "
          f"(min {min(loads):.1f}, max {max(loads):.1f})")
    print(f"slopes after a {args.warmup_minutes:g}-minute warm-up, MiB/min (samples {out}, {out.with_suffix('.csv')}):")
    print(f"{'process':28} {'RSS':>8} {'USS':>8} {'PSS':>8}   RSS after warm-up -> last (MiB)")

    def fmt(v: float | None) -> str:
        return f"{v:8.3f}" if v is not None else "       -"
    for name, row in summary.items():
        print(f"{name:28} {fmt(row['rss_slope'])} {fmt(row['uss_slope'])} {fmt(row['pss_slope'])}   "
              f"{row['rss_after_warmup'] or 0:.1f} -> {row['rss_last'] or 0:.1f}"
              + (f" ({row['pids']} pids: restarted)" if (row["pids"] or 0) > 1 else ""))


if __name__ == "__main__":
    main()
