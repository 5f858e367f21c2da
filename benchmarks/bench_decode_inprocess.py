"""Batch-1 greedy decode of the default model in-process: stagemesh's engine next to
transformers' generate, same machine, same run. Prints tokens/s and the ratio.

    .venv/bin/python benchmarks/bench_decode_inprocess.py [--tokens 128] [--threads 2]
"""
from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402


def bench_stagemesh(model_dir, prompt_ids, tokens: int) -> float:
    from scheduler.local_engine import LocalEngine
    from stagemesh.sampling_params import SamplingParams

    engine = LocalEngine(model_dir)
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    engine.generate([prompt_ids], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
    engine.add_request(prompt_ids, params)
    engine.step()  # prefill, not timed
    start = time.perf_counter()
    n = 1
    while engine.scheduler.has_unfinished():
        n += len(engine.step())
    return (n - 1) / (time.perf_counter() - start)


def bench_transformers(model_dir, prompt_ids, tokens: int) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([prompt_ids])
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=4, do_sample=False)  # warm-up
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
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    from stagemesh.default_model import default_model_dir

    model_dir = default_model_dir()
    prompt_ids = AutoTokenizer.from_pretrained(model_dir).encode("Write a short story about a lighthouse keeper.")
    ours = bench_stagemesh(model_dir, prompt_ids, args.tokens)
    theirs = bench_transformers(model_dir, prompt_ids, args.tokens)
    print(f"default model, batch 1, {args.tokens} greedy tokens, {args.threads} threads")
    print(f"stagemesh in-process : {ours:8.1f} tokens/s")
    print(f"transformers generate: {theirs:8.1f} tokens/s")
    print(f"ratio                : {ours / theirs:8.2f}x (target >= 1.5x)")


if __name__ == "__main__":
    main()
