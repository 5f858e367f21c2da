"""Speculative decoding's TPOT on the default model, in-process: copy-heavy prompts (repeat a text, edit
code: prompt lookup finds the answer in the prompt) against open-ended ones, at concurrency 1 and 8, each
with and without speculation. Prints the mean TPOT of each arm, the ratio (without / with: > 1 is faster)
and the acceptance (draft tokens accepted, mean tokens per verifying step). Greedy, chat template.

The arms are two engines in this process, run alternately, round after round, so that load from elsewhere
on a shared machine hits both; each round checks that both produced the same tokens.

    .venv/bin/python benchmarks/bench_spec_decode.py [--rounds 3] [--tokens 128] \\
        [--speculative-config '{"method": "ngram", "num_speculative_tokens": 4, ...}'] [--dtype float32]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
TEXT = ("The lighthouse stood at the edge of the cliff, its white tower striped with red. Every night the keeper "
        "climbed the spiral stairs, trimmed the wick and wound the clockwork that turned the great lens. Ships "
        "passing in the dark saw its beam sweep across the water once every ten seconds, and knew where the rocks "
        "were. In the morning he wrote the weather in his log, fed the gulls, and slept until the afternoon.")
CODE = '''def total_price(items, tax_rate):
    total = 0
    for item in items:
        price = item["price"] * item["quantity"]
        if item.get("discount"):
            price = price * (1 - item["discount"])
        total = total + price
    total = total * (1 + tax_rate)
    return round(total, 2)
'''
COPY_HEAVY = [
    f"Repeat the following text exactly, word for word:\n\n{TEXT}",
    f"Rewrite this function, renaming the variable `total` to `subtotal`. Output only the code.\n\n{CODE}",
    f"Copy this paragraph and put it in quotes:\n\n{TEXT}",
    f"Add a docstring to this function and output the whole function.\n\n{CODE}",
    f"Here is a story. Repeat it back to me.\n\n{TEXT}",
    f"Convert this function so that it uses type hints. Output the full code.\n\n{CODE}",
    f"Proofread this text and output it unchanged if it is correct:\n\n{TEXT}",
    f"Rename the function to compute_total and print the code again.\n\n{CODE}",
]
OPEN_ENDED = [
    "Write a short story about a dragon who learns to cook.",
    "What are the health benefits of regular exercise? Explain in detail.",
    "Describe a day in the life of a medieval blacksmith.",
    "Explain how a rainbow forms, for a ten-year-old.",
    "Write a poem about the ocean at night.",
    "Give me ideas for a birthday party for my grandmother.",
    "What would happen if the moon disappeared?",
    "Invent a new board game and explain its rules.",
]


async def timed(engine, prompts: list[list[int]], sampling) -> list[tuple[float, int, list[int]]]:
    """(TPOT, output tokens, tokens) of each request, all sent at once."""
    from stagemesh.core.engine_request import EngineRequest

    async def one(i: int, prompt: list[int]):
        first = last = None
        tokens = []
        async for out in engine.driver.submit(EngineRequest(f"bench-{time.monotonic_ns()}-{i}", prompt, sampling)):
            now = time.perf_counter()
            first = first if first is not None else now
            last = now
            tokens += out.new_token_ids
        return ((last - first) / (len(tokens) - 1) if len(tokens) > 1 else float("nan")), len(tokens), tokens

    return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))


def run(engine, prompts, sampling):
    return engine._loop.run_until_complete(timed(engine, prompts, sampling))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=128, help="max_tokens of each request")
    parser.add_argument("--speculative-config", default=json.dumps(NGRAM))
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    from stagemesh.entry.local_engine import LocalEngine
    from stagemesh.core.default_model import default_model_dir
    from stagemesh.core.sampling_params import SamplingParams

    model_dir = default_model_dir()
    tok = AutoTokenizer.from_pretrained(model_dir)
    encode = lambda text: tok.encode(tok.apply_chat_template(  # noqa: E731
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False), add_special_tokens=False)
    workloads = {"copy-heavy": [encode(t) for t in COPY_HEAVY], "open-ended": [encode(t) for t in OPEN_ENDED]}
    sampling = SamplingParams(max_tokens=args.tokens)
    engines = {"off": LocalEngine.of(model_dir, dtype=args.dtype),
               "on": LocalEngine.of(model_dir, dtype=args.dtype, speculative_config=args.speculative_config)}
    tpot = {}  # (workload, concurrency, arm) -> TPOTs of every request of every round
    accepted = {}  # (workload, concurrency) -> (drafts, draft tokens, accepted) over the rounds
    mismatches = 0
    try:
        for engine in engines.values():
            run(engine, workloads["open-ended"][:2], SamplingParams(max_tokens=8))  # warm-up
        for r in range(args.rounds):
            for name, prompts in workloads.items():
                for concurrency in (1, 8):
                    batches = [prompts[i:i + concurrency] for i in range(0, len(prompts), concurrency)]
                    arms = ["off", "on"] if r % 2 == 0 else ["on", "off"]
                    tokens = {}
                    for arm in arms:
                        spec = engines[arm].stats().spec_decode
                        before = (spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens) if spec else None
                        results = [res for batch in batches for res in run(engines[arm], batch, sampling)]
                        tpot.setdefault((name, concurrency, arm), []).extend(t for t, _, _ in results)
                        tokens[arm] = [t for _, _, t in results]
                        if before is not None:
                            spec = engines[arm].stats().spec_decode
                            delta = (spec.num_drafts - before[0], spec.num_draft_tokens - before[1],
                                     spec.num_accepted_tokens - before[2])
                            old = accepted.get((name, concurrency), (0, 0, 0))
                            accepted[(name, concurrency)] = tuple(a + b for a, b in zip(old, delta))
                    mismatches += sum(a != b for a, b in zip(tokens["off"], tokens["on"]))
            print(f"round {r + 1} of {args.rounds} done", flush=True)
    finally:
        for engine in engines.values():
            engine.close()
    print(f"\ndefault model, greedy, max_tokens {args.tokens}, {args.threads} threads, {args.rounds} rounds, "
          f"dtype {args.dtype or 'auto'}; speculation: {args.speculative_config}")
    print(f"{'workload':<12}{'conc':>5}{'TPOT off (ms)':>15}{'TPOT on (ms)':>14}{'ratio':>8}{'accepted':>10}"
          f"{'tokens/step':>13}")
    for name in workloads:
        for concurrency in (1, 8):
            off = statistics.mean(tpot[(name, concurrency, "off")]) * 1000
            on = statistics.mean(tpot[(name, concurrency, "on")]) * 1000
            drafts, draft_tokens, acc = accepted.get((name, concurrency), (0, 0, 0))
            rate = acc / draft_tokens if draft_tokens else 0.0
            per_step = 1 + acc / drafts if drafts else 1.0
            print(f"{name:<12}{concurrency:>5}{off:>15.1f}{on:>14.1f}{off / on:>7.2f}x{rate:>9.0%}{per_step:>13.2f}")
    print(f"requests whose tokens differ between the arms: {mismatches} (greedy: expected 0, up to fp32 ties)")


if __name__ == "__main__":
    main()
