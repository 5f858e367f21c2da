"""The layer plans (stage_worker/layer_plan.py: a dense decoder layer's kernels called from C++) against the
layers' own Python, in-process, the default model, same run: batch-1 decode time per token (TPOT) and the
throughput of a batch of concurrent requests, plans on and off alternating every round (so load from
elsewhere on a shared machine hits both). The outputs are the same bits either way (tests/test_layer_plan.py).

Arms: fp32, bf16 (--dtype bfloat16), gguf-q4_1 (the embedded GGUF).

    .venv/bin/python benchmarks/bench_layer_plan.py [--rounds 5] [--tokens 64] [--batch 32] [--threads 2] \\
        [--arms fp32,bf16,gguf-q4_1]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks.bench_bf16_cpu import standard_batch, throughput, tpot_ms  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, default=32, help="concurrent requests (0: batch 1 only)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--arms", default="fp32,bf16,gguf-q4_1")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from transformers import AutoTokenizer

    from stage_worker import layer_plan
    from stage_worker.cpu_isa import cpu_flags, describe_isa
    from stagemesh.core.default_model import default_model_dir, gguf_path
    from stagemesh.entry.local_engine import LocalEngine

    model_dir = default_model_dir()
    prompt_ids = AutoTokenizer.from_pretrained(model_dir).encode("Write a short story about a lighthouse keeper.")
    prompts, outputs = standard_batch(args.batch)
    table = {"fp32": {}, "bf16": dict(dtype="bfloat16"),
             "gguf-q4_1": dict(quantization="gguf", gguf_file=str(gguf_path()))}
    print(f"default model in-process, {args.threads} threads, {args.rounds} rounds (medians; rounds in brackets); "
          f"{describe_isa(cpu_flags())}")
    for arm in args.arms.split(","):
        figures = {on: {"tpot": [], "tput": []} for on in (False, True)}
        with LocalEngine.of(model_dir, **table[arm]) as engine:
            try:
                for on in figures:  # warm-up
                    layer_plan.enable(on)
                    tpot_ms(engine, prompt_ids, 4)
                    if args.batch:
                        throughput(engine, prompts[:8], [8] * len(prompts[:8]))
                for _ in range(args.rounds):
                    for on, f in figures.items():
                        layer_plan.enable(on)
                        f["tpot"].append(tpot_ms(engine, prompt_ids, args.tokens))
                        if args.batch:
                            f["tput"].append(throughput(engine, prompts, outputs))
            finally:
                layer_plan.enable(True)
        med = {on: {k: statistics.median(v) if v else float("nan") for k, v in f.items()} for on, f in figures.items()}
        for on, f in figures.items():
            print(f"{arm:10s} {'plans' if on else 'python':6s}: batch-1 TPOT {med[on]['tpot']:6.2f} ms "
                  f"[{', '.join(f'{x:.2f}' for x in f['tpot'])}]  batch-{args.batch} {med[on]['tput']:6.1f} tok/s "
                  f"[{', '.join(f'{x:.1f}' for x in f['tput'])}]")
        print(f"{arm:10s} plans vs python: TPOT {med[False]['tpot'] / med[True]['tpot']:.3f}x faster, "
              f"throughput {med[True]['tput'] / med[False]['tput']:.3f}x")


if __name__ == "__main__":
    main()
