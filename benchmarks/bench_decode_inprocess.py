"""Batch-1 greedy decode of the default model in-process: stagemesh's engine next to
transformers' generate, same machine, same run. Prints tokens/s and the ratio.

The two alternate for --rounds rounds and the medians are compared, so that a burst of
load from elsewhere on a shared machine hits both.

    .venv/bin/python benchmarks/bench_decode_inprocess.py [--tokens 128] [--threads 2] [--rounds 3]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402


def bench_stagemesh(engine, prompt_ids, tokens: int) -> float:
    from stagemesh.core.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    start, n = None, 0
    for out in engine.stream(prompt_ids, params):
        if start is None:
            start = time.perf_counter()  # the prefill's token is out: decode from here
        else:
            n += len(out.new_token_ids)
    return n / (time.perf_counter() - start)


def bench_transformers(model, prompt_ids, tokens: int) -> float:
    ids = torch.tensor([prompt_ids])
    with torch.inference_mode():
        timings = []
        for n in (1, tokens):  # decode rate = extra tokens / extra time (prefill cancels out)
            start = time.perf_counter()
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
            timings.append(time.perf_counter() - start)
    return (tokens - 1) / (timings[1] - timings[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from stagemesh.entry.local_engine import LocalEngine
    from stagemesh.core.default_model import default_model_dir
    from stagemesh.core.sampling_params import SamplingParams

    model_dir = default_model_dir()
    prompt_ids = AutoTokenizer.from_pretrained(model_dir).encode("Write a short story about a lighthouse keeper.")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        model.generate(torch.tensor([prompt_ids]), max_new_tokens=4, do_sample=False)  # warm-up
    ours, theirs = [], []
    with LocalEngine.of(model_dir) as engine:
        engine.generate([prompt_ids], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
        for _ in range(args.rounds):
            ours.append(bench_stagemesh(engine, prompt_ids, args.tokens))
            theirs.append(bench_transformers(model, prompt_ids, args.tokens))
    ours_med, theirs_med = statistics.median(ours), statistics.median(theirs)
    print(f"default model, batch 1, {args.tokens} greedy tokens, {args.threads} threads, {args.rounds} rounds")
    print(f"stagemesh in-process : {ours_med:8.1f} tokens/s (rounds: {', '.join(f'{x:.1f}' for x in ours)})")
    print(f"transformers generate: {theirs_med:8.1f} tokens/s (rounds: {', '.join(f'{x:.1f}' for x in theirs)})")
    print(f"ratio                : {ours_med / theirs_med:8.2f}x (target >= 1.5x)")


if __name__ == "__main__":
    main()
