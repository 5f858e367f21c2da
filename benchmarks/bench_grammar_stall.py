"""What a constraint's compile costs the other streams: a greedy stream of 300 tokens runs while, one after
the other, (1) the first constrained request a fresh mesh sees (a json_object: the last stage's compiler is
made then unless it was made at start) and (2) a hostile regex (about 7 s of xgrammar compile on a 2-core
EPYC) are sent; prints each one's status and time and the stream's longest gap between tokens while each
was in flight, against its median gap.

    .venv/bin/python benchmarks/bench_grammar_stall.py               # serves a fresh mesh itself
    .venv/bin/python benchmarks/bench_grammar_stall.py --url http://127.0.0.1:8000
"""
from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_process import start_serve, stop  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"
LETTERS = "abcdefghijklmnopqrstuvwxyz"
HOSTILE = "".join(f"[{LETTERS[i]}-z0-9 ]{{0,190}}{LETTERS[i]}," for i in range(12))
PROBES = {"first json_object": {"response_format": {"type": "json_object"}, "max_tokens": 5},
          "hostile regex": {"structured_outputs": {"regex": HOSTILE}, "max_tokens": 5}}


def run(base: str) -> None:
    stamps: list[float] = []

    def stream() -> None:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell a long story."}], "max_tokens": 300,
                "temperature": 0, "ignore_eos": True, "stream": True}
        with requests.post(f"{base}/v1/chat/completions", json=body, stream=True, timeout=600) as r:
            for line in r.iter_lines():
                if line.startswith(b"data: {"):
                    stamps.append(time.monotonic())

    thread = threading.Thread(target=stream)
    thread.start()
    while len(stamps) < 10:
        time.sleep(0.05)
    windows = []
    for name, extra in PROBES.items():
        start = time.monotonic()
        r = requests.post(f"{base}/v1/chat/completions", timeout=600, json={
            "model": MODEL, "messages": [{"role": "user", "content": "Describe a person."}], **extra})
        end = time.monotonic()
        windows.append((name, start, end, r.status_code))
        time.sleep(0.5)
    thread.join()
    gaps = [(b, b - a) for a, b in zip(stamps, stamps[1:])]
    median = statistics.median(g for _, g in gaps)
    for name, start, end, status in windows:
        during = [g for t, g in gaps if start <= t <= end + 0.5]
        print(f"{name:18s} HTTP {status} in {end - start:5.2f} s; the stream's longest gap meanwhile "
              f"{max(during, default=0) * 1000:6.0f} ms (median gap {median * 1000:.0f} ms)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default=None, help="a served mesh (default: serve a fresh one here)")
    a = p.parse_args()
    if a.url:
        run(a.url)
        return
    proc, base = start_serve([])
    try:
        run(base)
    finally:
        stop(proc)


if __name__ == "__main__":
    main()
