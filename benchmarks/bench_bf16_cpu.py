"""bf16 against fp32 on CPU, in-process, same model, same run: batch-1 decode time per token
(TPOT) and the throughput of a batch of concurrent requests. The two engines alternate for
--rounds rounds and the medians are compared, so load from elsewhere on a shared machine hits both.

The bf16 engine is `--dtype bfloat16`: bf16 weights packed for kernels/csrc/bf16_linear.cpp (fp32
sums), bf16 activations between the layers. Targets (issue 22): batch-1 TPOT <= 0.75x fp32,
throughput >= 1.6x fp32. Where the CPU has a better bf16 family than avx2 (avx512_bf16, kernels/isa.py),
a third engine runs bf16 on the avx2 kernels (STAGEMESH_CPU_ISA=avx2 while it loads), to compare them.

    .venv/bin/python benchmarks/bench_bf16_cpu.py [--rounds 3] [--tokens 64] [--batch 32]
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402


def standard_batch(n: int) -> tuple[list[list[int]], list[int]]:
    """The in-process benchmarks' batch: n seeded prompts of 16-256 random tokens and their output lengths
    (16-128), the same every run."""
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(rng.randint(16, 256))] for _ in range(n)]
    return prompts, [rng.randint(16, 128) for _ in range(n)]


def tpot_ms(engine, prompt_ids: list[int], tokens: int, temperature: float = 0.0) -> float:
    """Batch 1: the time per output token after the first (prefill excluded); greedy unless a temperature."""
    from stagemesh.core.sampling_params import SamplingParams

    start, n = None, 0
    for out in engine.stream(prompt_ids, SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=temperature)):
        if start is None:
            start = time.perf_counter()
        else:
            n += len(out.new_token_ids)
    return (time.perf_counter() - start) / n * 1e3


def throughput(engine, prompts: list[list[int]], outputs: list[int], temperature: float = 0.0) -> float:
    """Output tokens per second of all the requests at once (prefills included, as a server sees them)."""
    from stagemesh.core.sampling_params import SamplingParams

    params = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=temperature) for n in outputs]
    start = time.perf_counter()
    engine.generate(prompts, params)
    return sum(outputs) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64, help="batch-1 output tokens")
    parser.add_argument("--batch", type=int, default=32, help="concurrent requests (prompts 16-256, outputs 16-128)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    from stagemesh.entry.local_engine import LocalEngine
    from stagemesh.core.default_model import default_model_dir

    model_dir = default_model_dir()
    prompt_ids = AutoTokenizer.from_pretrained(model_dir).encode("Write a short story about a lighthouse keeper.")
    prompts, outputs = standard_batch(args.batch)
    from kernels import cpu_ops, isa

    arms = ["float32", "bfloat16"]
    if cpu_ops.load() is not None and cpu_ops.bf16_family() != "avx2":
        arms.append("bfloat16/avx2")
    engines = {}
    for arm in arms:
        dtype, _, family = arm.partition("/")
        if family:
            os.environ["STAGEMESH_CPU_ISA"] = family  # the weights are packed for this family at load
        try:
            engines[arm] = LocalEngine.of(model_dir, dtype=dtype)
        finally:
            os.environ.pop("STAGEMESH_CPU_ISA", None)
    figures = {arm: {"tpot": [], "tput": []} for arm in arms}
    try:
        for engine in engines.values():
            tpot_ms(engine, prompt_ids, 4)  # warm-up
        for _ in range(args.rounds):
            for dtype, engine in engines.items():
                figures[dtype]["tpot"].append(tpot_ms(engine, prompt_ids, args.tokens))
                figures[dtype]["tput"].append(throughput(engine, prompts, outputs))
    finally:
        for engine in engines.values():
            engine.close()
    med = {d: {k: statistics.median(v) for k, v in f.items()} for d, f in figures.items()}
    print(f"default model in-process, {args.threads} threads, {args.rounds} rounds (medians; rounds in brackets)")
    print(isa.describe(isa.cpu_flags(), cpu_ops.load() is not None))
    for d, f in figures.items():
        print(f"{d:13s}: batch-1 TPOT {med[d]['tpot']:6.1f} ms [{', '.join(f'{x:.1f}' for x in f['tpot'])}]   "
              f"batch-{args.batch} {med[d]['tput']:6.1f} tok/s [{', '.join(f'{x:.1f}' for x in f['tput'])}]")
    print(f"bf16 / fp32: TPOT {med['bfloat16']['tpot'] / med['float32']['tpot']:.2f}x (target <= 0.75), "
          f"throughput {med['bfloat16']['tput'] / med['float32']['tput']:.2f}x (target >= 1.6)")
    if "bfloat16/avx2" in med:
        print(f"bf16 {cpu_ops.bf16_family()} / bf16 avx2: TPOT "
              f"{med['bfloat16']['tpot'] / med['bfloat16/avx2']['tpot']:.2f}x, "
              f"throughput {med['bfloat16']['tput'] / med['bfloat16/avx2']['tput']:.2f}x")


if __name__ == "__main__":
    main()
