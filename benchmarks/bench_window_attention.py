"""Sliding-window and attention-sink attention on CPU: the family kernel (kernels.cpu_ops.paged_attention_window,
each row from its window's first position, a sink through the row's lse) against kernels.masked_attention's torch
reference, which kernels.paged_attention ran for these layers before. Same process, arms in turn.

- the attention alone: a decode step of --rows rows over contexts of 1,000-4,000 positions, Gemma-3-1B's heads
  (4 query heads, 1 KV head of 256, a window of 512) and gpt-oss's (64 heads, 8 KV heads of 64, a window of 128
  and sinks), bf16;
- end to end: batch-1 TPOT and a batch's output tokens per second of a random Gemma 3 (bench_hybrid_kv's model)
  in-process, with the fused kernel and with the reference.

    .venv/bin/python benchmarks/bench_window_attention.py [--rounds 5] [--rows 32]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

import kernels  # noqa: E402
from benchmarks.bench_bf16_cpu import tpot_ms  # noqa: E402
from benchmarks.bench_hybrid_kv import isa, write_model  # noqa: E402
from kernels import cpu_ops  # noqa: E402
from kernels.masked_attention import AttentionMask  # noqa: E402

SHAPES = {"Gemma-3-1B (4/1 heads of 256, window 512)": (4, 1, 256, 512, False),
          "gpt-oss (64/8 heads of 64, window 128, sinks)": (64, 8, 64, 128, True)}


@contextmanager
def reference_only():
    """kernels.paged_attention as it was: every windowed or sink layer on the torch reference."""
    fused = cpu_ops.paged_attention_window
    cpu_ops.paged_attention_window = lambda *a, **k: None
    try:
        yield
    finally:
        cpu_ops.paged_attention_window = fused


def decode_step(rows: int, heads: int, kv_heads: int, dim: int, bs: int = 16):
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(1000, 4000, (rows,), generator=g)
    blocks = [int(-(-n // bs)) for n in lens]
    tables = torch.zeros(rows, max(blocks), dtype=torch.int32)
    at = 0
    for r, n in enumerate(blocks):
        tables[r, :n] = torch.arange(at, at + n)
        at += n
    k = torch.randn(at, bs, kv_heads, dim, generator=g).bfloat16()
    v = torch.randn(at, bs, kv_heads, dim, generator=g).bfloat16()
    q = torch.randn(rows, heads, dim, generator=g).bfloat16()
    qsl = torch.arange(rows + 1, dtype=torch.int32)
    return q, k, v, tables, lens.to(torch.int32), qsl


def timed(fn, repeat: int = 5) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=1024)
    parser.add_argument("--output", type=int, default=32)
    args = parser.parse_args()
    print(f"machine: {isa()}; torch {torch.__version__}, {torch.get_num_threads()} threads; attention family "
          f"{cpu_ops.current_attention_family()}")
    print(f"\n## the attention alone: a decode step of {args.rows} rows, contexts of 1,000-4,000, bf16 (ms)\n")
    print("| heads | fused kernel | torch reference | speed-up |")
    print("|---|---|---|---|")
    for name, (heads, kv_heads, dim, window, sinks) in SHAPES.items():
        step = decode_step(args.rows, heads, kv_heads, dim)
        mask = AttentionMask(window=window, sinks=torch.linspace(-1, 1, heads) if sinks else None)
        scale = dim ** -0.5
        fused, ref = [], []
        for _ in range(args.rounds):
            fused.append(timed(lambda: kernels.paged_attention(*step, scale, mask=mask)))
            with reference_only():
                ref.append(timed(lambda: kernels.paged_attention(*step, scale, mask=mask)))
        f, r = statistics.median(fused), statistics.median(ref)
        print(f"| {name} | {f:.2f} | {r:.2f} | {r / f:.1f}x |")
    from stagemesh.core.sampling_params import SamplingParams
    from stagemesh.entry.local_engine import LocalEngine

    print("\n## end to end: a random Gemma 3 (12 layers, hidden 640, window 512, bf16) in-process\n")
    with tempfile.TemporaryDirectory() as tmp:
        model = write_model(Path(tmp) / "gemma3", 12, 640, 512)
        gen = torch.Generator().manual_seed(1)
        prompts = [torch.randint(10, 8000, (args.prompt,), generator=gen).tolist() for _ in range(8)]
        with LocalEngine.of(model, dtype="bfloat16", max_num_batched_tokens=2048, skip_server_warmup=True,
                            enable_prefix_caching=False) as engine:
            tpot_ms(engine, prompts[0][:256], 4)
            results: dict[str, dict[str, list[float]]] = {"fused": {"tpot": [], "tps": []},
                                                         "reference": {"tpot": [], "tps": []}}
            for r in range(max(2, args.rounds // 2)):
                for arm in results:
                    with reference_only() if arm == "reference" else _nothing():
                        tpot = tpot_ms(engine, prompts[r % 8], args.output)
                        start = time.perf_counter()
                        engine.generate(prompts, SamplingParams(max_tokens=args.output, ignore_eos=True))
                        tps = len(prompts) * args.output / (time.perf_counter() - start)
                    results[arm]["tpot"].append(tpot)
                    results[arm]["tps"].append(tps)
    print(f"| arm | batch-1 TPOT after {args.prompt} tokens (ms) | 8 requests of {args.prompt}, {args.output} out: "
          "out tok/s |")
    print("|---|---|---|")
    for arm, m in results.items():
        print(f"| {arm} | {statistics.median(m['tpot']):.1f} | {statistics.median(m['tps']):.1f} |")


@contextmanager
def _nothing():
    yield


if __name__ == "__main__":
    main()
