"""Random sampling's draw (stage_worker/rejection.py `draw`: inverse transform on a float64 running sum)
against torch.multinomial, which it replaced: one row of the default model's vocabulary alone, then the
default model in-process at temperature 1 (batch-1 TPOT, and the throughput of a batch of concurrent
requests), the two draws alternating every round in one process.

    .venv/bin/python benchmarks/bench_sampling.py [--rounds 3] [--tokens 64] [--batch 32] [--threads 2]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks.bench_bf16_cpu import standard_batch, throughput, tpot_ms  # noqa: E402


def multinomial(weights: torch.Tensor, gen: torch.Generator) -> int:
    """The draw before: torch's own."""
    return int(torch.multinomial(weights, 1, generator=gen))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--gguf", action="store_true", help="the embedded GGUF instead of fp32")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from transformers import AutoTokenizer

    import stage_worker.sampler as sampler
    from stage_worker.cpu_isa import cpu_flags, describe_isa
    from stagemesh.core.default_model import default_model_dir, gguf_path
    from stagemesh.core.model_config import ModelConfig
    from stagemesh.entry.local_engine import LocalEngine

    model_dir = default_model_dir()
    arms = {"torch.multinomial": multinomial, "rejection.draw": sampler.draw}
    print(f"{args.threads} threads, {args.rounds} rounds (medians); {describe_isa(cpu_flags())}")
    vocab = ModelConfig.from_path(model_dir).vocab_size
    probs = torch.softmax(torch.randn(vocab, generator=torch.Generator().manual_seed(0)), -1)
    gen = torch.Generator().manual_seed(0)
    for name, fn in arms.items():
        times = []
        for _ in range(args.rounds):
            start = time.perf_counter()
            for _ in range(100):
                fn(probs, gen)
            times.append((time.perf_counter() - start) / 100 * 1e6)
        print(f"one row of {vocab}: {name:18s} {min(times):8.1f} us (best)")

    prompt_ids = AutoTokenizer.from_pretrained(model_dir).encode("Write a short story about a lighthouse keeper.")
    prompts, outputs = standard_batch(args.batch)
    kw = dict(quantization="gguf", gguf_file=str(gguf_path())) if args.gguf else {}
    figures = {name: {"tpot": [], "tput": []} for name in arms}
    with LocalEngine.of(model_dir, **kw) as engine:
        try:
            tpot_ms(engine, prompt_ids, 4, temperature=1.0)  # warm-up
            for _ in range(args.rounds):
                for name, fn in arms.items():
                    sampler.draw = fn
                    figures[name]["tpot"].append(tpot_ms(engine, prompt_ids, args.tokens, temperature=1.0))
                    figures[name]["tput"].append(throughput(engine, prompts, outputs, temperature=1.0))
        finally:
            sampler.draw = arms["rejection.draw"]
    model = "gguf-q4_1" if args.gguf else "fp32"
    for name, f in figures.items():
        print(f"{model} temperature 1, {name:18s}: batch-1 TPOT {statistics.median(f['tpot']):6.2f} ms "
              f"[{', '.join(f'{x:.2f}' for x in f['tpot'])}]  batch-{args.batch} {statistics.median(f['tput']):6.1f} "
              f"tok/s [{', '.join(f'{x:.1f}' for x in f['tput'])}]")


if __name__ == "__main__":
    main()
