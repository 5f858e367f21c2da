"""The pause a stream sees when its replica drains and hands it on: with its KV (--migration-policy kv) against
computed again (recompute), at 1,000 and 4,000 tokens of context.

Two replicas (a scheduler and one stage each; B names A with --kv-peer) behind a router; one greedy stream
with a prompt of N tokens runs on A; after 20 of its tokens A's scheduler is told to stop (--shutdown-timeout
0.5 s): the stream goes on on B. Prints per policy and context the gap between the last token from A and the
first from B (the pause), against the stream's median inter-token latency, and whether the tokens equal an
undisturbed run's.

    .venv/bin/python benchmarks/bench_migration.py [--contexts 1000,4000] [--model MODEL]

Without --model: the tests' wide tiny llama (random weights, a word tokenizer) with room for 8,192 positions.
"""
from __future__ import annotations

import argparse
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from mesh import Mesh, Router  # noqa: E402
from sse_client import stream  # noqa: E402

MAX_TOKENS = 120
DRAIN_AFTER = 20


def tiny_model(root: Path) -> Path:
    from tiny_models import make_tiny_model, with_word_tokenizer

    wide = make_tiny_model(root / "wide", hidden_size=512, intermediate_size=2048, num_attention_heads=8,
                           max_position_embeddings=8192)
    return with_word_tokenizer(wide, root / "model")


def one_run(model: Path, policy: str, context: int, log_dir: Path) -> dict:
    for sub in ("a", "b"):  # Mesh writes its logs there but makes no folder
        (log_dir / sub).mkdir(parents=True)
    words = " ".join(f"w{3 + (i * 7) % 380}" for i in range(context))
    body = {"model": "m", "prompt": words, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "stream": True, "return_token_ids": True}
    sched = ("--shutdown-timeout", "0.5", "--served-model-name", "m", "--migration-policy", policy,
             "--max-model-len", "8192")
    stage = ("--kv-cache-memory", str(64 * 2**20))
    times: list[float] = []
    with Mesh(model, [4], log_dir=log_dir / "a", scheduler_args=sched, stage_args=stage) as a, \
            Mesh(model, [4], log_dir=log_dir / "b", scheduler_args=(*sched, "--kv-peer", a.address),
                 stage_args=stage) as b, \
            Router(model, [a.address, b.address], ("--policy", "round-robin"), log_dir=log_dir) as router:
        undisturbed = stream([router.base_url], "/v1/completions", body, "warm")  # (round robin: A, B, A)
        stream([router.base_url], "/v1/completions", {**body, "prompt": "w5 w6", "max_tokens": 2}, "on-b")
        drained = threading.Event()

        def seen(out) -> None:
            times.append(time.monotonic())
            if len(times) == DRAIN_AFTER and not drained.is_set():
                drained.set()
                a.scheduler.send_signal(signal.SIGTERM)

        got = stream([router.base_url], "/v1/completions", body, "moved", on_event=seen)
        assert b.scheduler.poll() is None
    gaps = [y - x for x, y in zip(times, times[1:])]
    pause = max(gaps[DRAIN_AFTER - 1:]) if len(gaps) >= DRAIN_AFTER else float("nan")
    return {"pause": pause, "itl": statistics.median(gaps[:DRAIN_AFTER - 1]), "exact": got.token_ids ==
            undisturbed.token_ids, "tokens": len(got.token_ids)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", default="1000,4000")
    p.add_argument("--model", default=None)
    args = p.parse_args()
    from stage_worker.cpu_isa import cpu_flags, describe_isa

    root = Path(tempfile.mkdtemp(prefix="stagemesh-migration-"))
    model = Path(args.model) if args.model else tiny_model(root)
    print(f"model {args.model or 'the wide tiny llama (8,192 positions)'}; a stream of {MAX_TOKENS} tokens, its "
          f"replica drained after {DRAIN_AFTER}; {describe_isa(cpu_flags())}")
    for context in (int(c) for c in args.contexts.split(",")):
        rows = {policy: one_run(model, policy, context, root / f"{policy}-{context}") for policy in ("kv", "recompute")}
        kv, re = rows["kv"], rows["recompute"]
        print(f"context {context}: pause with its KV {kv['pause'] * 1000:.0f} ms, computed again "
              f"{re['pause'] * 1000:.0f} ms ({re['pause'] / kv['pause']:.1f}x); ITL p50 {kv['itl'] * 1000:.1f} / "
              f"{re['itl'] * 1000:.1f} ms; token-exact: {kv['exact']} / {re['exact']} ({kv['tokens']} tokens)")
    print(f"logs in {root}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
