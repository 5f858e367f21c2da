"""Two tenants, one flooding: what the other one sees, first come first served against the fair share.

`stagemesh serve` (--max-num-seqs 8, --api-keys-file with alpha and beta), once with --no-tenant-fair-share
(FCFS) and once with the fair share (the default). In each: beta's light requests alone (its solo latency);
then alpha floods (--flood-clients closed-loop clients, each sending long requests back to back, so its queue
never empties) for --seconds while beta sends light requests one after another. Prints, per mode and tenant,
TTFT and ITL p50 / p99 and the end-to-end latency, beta's latency under the flood against its solo latency
(target <= 4x), and the total throughput (tokens streamed per second within the flood window; the fair share's
target: within 5% of FCFS).

    .venv/bin/python benchmarks/bench_tenants.py [--model MODEL] [--seconds 60] [--flood-clients 16]

Without --model it serves the tests' wide tiny llama (random weights, a word tokenizer: a step takes a few
milliseconds on CPU, so the figures show the scheduling, as on a GPU, rather than a loaded CPU's matmuls).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from serve_process import start_serve, stop  # noqa: E402

KEYS = {"alpha": "key-alpha", "beta": "key-beta"}
NAME = "bench"


@dataclass
class Sample:
    tenant: str
    sent: float
    token_times: list[float] = field(default_factory=list)

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.sent

    @property
    def e2e(self) -> float:
        return self.token_times[-1] - self.sent

    @property
    def itl(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]


def one(base: str, tenant: str, prompt: str, max_tokens: int) -> Sample:
    sample = Sample(tenant, time.monotonic())
    body = {"model": NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with requests.post(f"{base}/v1/completions", json=body, stream=True, timeout=600,
                       headers={"Authorization": f"Bearer {KEYS[tenant]}"}) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if line.startswith(b"data: {"):
                if json.loads(line[6:])["choices"]:
                    sample.token_times.append(time.monotonic())
    return sample


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(int(q * len(values)), len(values) - 1)] if values else float("nan")


def flood(base: str, args) -> tuple[list[Sample], list[Sample], float, float]:
    """(alpha's samples, beta's, flood start, flood end): closed-loop alpha clients and one beta client."""
    start, stop_at = time.monotonic(), time.monotonic() + args.seconds
    alpha: list[Sample] = []
    beta: list[Sample] = []
    lock = threading.Lock()

    def client(tenant: str, prompt: str, max_tokens: int, out: list[Sample], pause: float) -> None:
        while time.monotonic() < stop_at:
            s = one(base, tenant, prompt, max_tokens)
            with lock:
                out.append(s)
            time.sleep(pause)

    threads = [threading.Thread(target=client, args=("alpha", prompt(args, i), args.flood_tokens, alpha, 0.0))
               for i in range(args.flood_clients)]
    for t in threads:
        t.start()
    time.sleep(args.seconds / 10)  # beta comes once the flood fills the queue
    threads.append(threading.Thread(target=client, args=("beta", prompt(args, -1), args.light_tokens, beta, 0.5)))
    threads[-1].start()
    for t in threads:
        t.join()
    return alpha, beta, start, stop_at


def prompt(args, i: int) -> str:
    """Client i's prompt (-1: beta's), in the model's words."""
    if not args.words:
        return "Say hello." if i < 0 else f"Tell a long story about ship {i}."
    return " ".join(f"w{3 + (7 * i + k) % 300}" for k in range(8 if i < 0 else 24))


def tiny_model(log_dir: Path) -> str:
    from tiny_models import make_tiny_model, with_word_tokenizer

    wide = make_tiny_model(log_dir / "wide", hidden_size=512, intermediate_size=2048, num_attention_heads=8)
    return str(with_word_tokenizer(wide, log_dir / "model"))


def report(mode: str, solo: list[Sample], alpha: list[Sample], beta: list[Sample], start: float, end: float
           ) -> dict:
    in_window = sum(1 for s in alpha + beta for t in s.token_times if start <= t <= end)
    throughput = in_window / (end - start)
    solo_e2e = statistics.median(s.e2e for s in solo)
    row = {"mode": mode, "throughput": throughput, "solo_e2e": solo_e2e,
           "beta_e2e_p50": statistics.median(s.e2e for s in beta) if beta else float("nan"),
           "beta_e2e_max": max((s.e2e for s in beta), default=float("nan"))}
    print(f"{mode}: total throughput {throughput:.1f} tokens/s within the flood window; beta solo e2e "
          f"{solo_e2e * 1000:.0f} ms")
    for tenant, samples in (("alpha", alpha), ("beta", beta)):
        itl = [x for s in samples for x in s.itl]
        ttft = [s.ttft for s in samples]
        print(f"  {tenant}: {len(samples)} requests, TTFT p50 {pct(ttft, .5) * 1000:.0f} / p99 "
              f"{pct(ttft, .99) * 1000:.0f} ms, ITL p50 {pct(itl, .5) * 1000:.1f} / p99 {pct(itl, .99) * 1000:.1f} ms, "
              f"e2e p50 {pct([s.e2e for s in samples], .5) * 1000:.0f} ms")
    print(f"  beta under the flood against solo: e2e p50 {row['beta_e2e_p50'] / solo_e2e:.2f}x, worst "
          f"{row['beta_e2e_max'] / solo_e2e:.2f}x (target <= 4x)")
    return row


def run_mode(mode: str, args, keys_file: Path, log_dir: Path) -> dict:
    extra = ["--no-tenant-fair-share"] if mode == "fcfs" else []
    proc, base = start_serve([args.model, "--served-model-name", NAME, "--max-num-seqs", "8", "--api-keys-file",
                              str(keys_file), *extra], log_dir / f"serve-{mode}.log")
    try:
        one(base, "beta", prompt(args, -1), 4)
        solo = [one(base, "beta", prompt(args, -1), args.light_tokens) for _ in range(args.solo)]
        alpha, beta, start, end = flood(base, args)
        return report(mode, solo, alpha, beta, start, end)
    finally:
        stop(proc)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: the tests' wide tiny llama")
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--flood-clients", type=int, default=16)
    p.add_argument("--flood-tokens", type=int, default=128)
    p.add_argument("--light-tokens", type=int, default=16)
    p.add_argument("--solo", type=int, default=5)
    args = p.parse_args()
    from stage_worker.cpu_isa import cpu_flags, describe_isa

    print(f"alpha: {args.flood_clients} clients x {args.flood_tokens} tokens back to back for {args.seconds:.0f} s; "
          f"beta: {args.light_tokens}-token requests one after another; --max-num-seqs 8; model "
          f"{args.model or 'the wide tiny llama'}; {describe_isa(cpu_flags())}")
    log_dir = Path(tempfile.mkdtemp(prefix="stagemesh-tenants-"))
    model = args.model or tiny_model(log_dir)
    keys_file = log_dir / "keys.json"
    keys_file.write_text(json.dumps({"tenants": {t: {"keys": [k]} for t, k in KEYS.items()}}))
    rows = {mode: run_mode(mode, argparse.Namespace(**{**vars(args), "model": model, "words": not args.model}),
                           keys_file, log_dir)
            for mode in ("fcfs", "fair")}
    fair, fcfs = rows["fair"], rows["fcfs"]
    print(f"fair share against FCFS: throughput {fair['throughput'] / fcfs['throughput']:.3f}x (target >= 0.95); "
          f"beta's worst e2e against solo {fcfs['beta_e2e_max'] / fcfs['solo_e2e']:.1f}x -> "
          f"{fair['beta_e2e_max'] / fair['solo_e2e']:.1f}x; logs in {log_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
