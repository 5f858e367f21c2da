"""The gateway's latency while a request's own chat template loops without end: /health p50 / p99 and a small
chat stream's time to first token, at rest and while one hostile template (10^10 loop iterations) renders in
the router's template worker, as ratios. A real `stagemesh router --trust-request-chat-template` over a real
replica of a tiny random model that carries the default model's tokenizer and chat template, so that the
model's own work is negligible and what is measured is the gateway's.

    .venv/bin/python benchmarks/bench_hostile_template.py [--seconds 4] [--streams 20] [--timeout 10]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))

from mesh import Mesh, Router  # noqa: E402
from tiny_models import make_tiny_model  # noqa: E402

from stagemesh.core.default_model import default_model_dir  # noqa: E402

HOSTILE = "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}"
ASK = [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "Name a colour."}]


def tiny_model_with_default_tokenizer(target: Path) -> Path:
    """A 2-layer random llama with the default model's vocabulary, tokenizer and chat template."""
    source = default_model_dir()
    make_tiny_model(target, "llama", num_hidden_layers=2, vocab_size=49152, max_position_embeddings=2048)
    for f in source.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, target / f.name)
    return target


def health_latencies(base: str, seconds: float) -> list[float]:
    out, session = [], requests.Session()
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        start = time.perf_counter()
        assert session.get(f"{base}/health", timeout=30).status_code == 200
        out.append(time.perf_counter() - start)
        time.sleep(0.02)
    return out


def ttft(base: str) -> float:
    body = {"messages": ASK, "max_tokens": 4, "ignore_eos": True, "stream": True, "temperature": 0}
    start = time.perf_counter()
    with requests.post(f"{base}/v1/chat/completions", json=body, stream=True, timeout=60) as resp:
        for line in resp.iter_lines():
            if line.startswith(b"data: {") and json.loads(line[6:])["choices"][0]["delta"].get("content"):
                return time.perf_counter() - start
    raise RuntimeError("the stream gave no token")


def measure(base: str, seconds: float, streams: int) -> dict[str, list[float]]:
    return {"/health": health_latencies(base, seconds), "TTFT": [ttft(base) for _ in range(streams)]}


class Hostile(threading.Thread):
    """Sends the hostile template again each time the router stops it, until told to stop."""

    def __init__(self, base: str):
        super().__init__(daemon=True)
        self.base, self.stop, self.answers = base, threading.Event(), []

    def run(self) -> None:
        body = {"messages": ASK, "chat_template": HOSTILE, "max_tokens": 4}
        while not self.stop.is_set():
            start = time.perf_counter()
            resp = requests.post(f"{self.base}/v1/chat/completions", json=body, timeout=120)
            self.answers.append((resp.status_code, time.perf_counter() - start, resp.json()["error"]["message"]))


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=4.0, help="of /health probes (every 20 ms) per phase")
    parser.add_argument("--streams", type=int, default=20, help="small chat streams per phase, one at a time")
    parser.add_argument("--timeout", type=float, default=10.0, help="the router's --chat-template-timeout")
    args = parser.parse_args()
    from kernels import isa

    with tempfile.TemporaryDirectory() as tmp:
        model = tiny_model_with_default_tokenizer(Path(tmp) / "model")
        flags = ("--trust-request-chat-template", "--chat-template-timeout", str(args.timeout))
        with Mesh(model, [2], stage_args=("--threads", "1")) as mesh, Router(model, [mesh.address], flags) as router:
            measure(router.base_url, 0.5, 3)  # warm-up
            rest = measure(router.base_url, args.seconds, args.streams)
            hostile = Hostile(router.base_url)
            hostile.start()
            time.sleep(0.5)  # it is rendering
            busy = measure(router.base_url, args.seconds, args.streams)
            hostile.stop.set()
            hostile.join(args.timeout + 30)
    print(isa.describe(isa.cpu_flags()))
    print(f"{os.cpu_count()} CPUs; the router's --chat-template-timeout {args.timeout:g} s; tiny model, the default "
          "model's tokenizer and template")
    for name in rest:
        a, b = rest[name], busy[name]
        print(f"{name:8s} p50 {pct(a, .5) * 1e3:7.2f} ms -> {pct(b, .5) * 1e3:7.2f} ms ({pct(b, .5) / pct(a, .5):.2f}x)"
              f"   p99 {pct(a, .99) * 1e3:7.2f} ms -> {pct(b, .99) * 1e3:7.2f} ms ({pct(b, .99) / pct(a, .99):.2f}x)"
              f"   max {max(b) * 1e3:7.2f} ms   ({len(a)} / {len(b)} samples, at rest -> while hostile)")
    for status, took, message in hostile.answers:
        print(f"hostile template: {status} after {took:.2f} s: {message}")
    print(f"mean TTFT at rest {statistics.mean(rest['TTFT']) * 1e3:.1f} ms, while hostile "
          f"{statistics.mean(busy['TTFT']) * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
