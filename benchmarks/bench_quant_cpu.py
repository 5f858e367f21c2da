"""Quantised weights against fp32 and bf16 on CPU, in-process, the default model, same run: batch-1 decode
time per token (TPOT) and the throughput of a batch of concurrent requests, for every arm in turn each round
(so load from elsewhere on a shared machine hits them all); optionally llama.cpp's llama-bench on the same
GGUF and threads between the rounds. Quality per arm: teacher-forced top-1 agreement with fp32 and
perplexity on a fixed text.

Arms: fp32, bf16 (--dtype bfloat16), gguf-q4_1 (the embedded GGUF as it is), gguf-q8_0 (a Q8_0 GGUF: --q8-gguf,
e.g. made by llama.cpp's llama-quantize), w8a16, w8a8 (int8 quantised at load). A quantised arm named
ARM@FAMILY (gguf-q4_1@avx2) runs its products on that kernel family (kernels/isa.py), to compare the families
in one run; gguf-q4_1-f32scales is the embedded GGUF with its scales and mins widened to fp32 (the layout before
they were kept in fp16 as the file has them).

    .venv/bin/python benchmarks/bench_quant_cpu.py [--rounds 3] [--tokens 64] [--batch 32] \
        [--llama-bench /tmp/llama.cpp/build/bin/llama-bench] [--q8-gguf /tmp/smol-q8_0.gguf] [--arms fp32,gguf-q4_1]

--products instead times the products alone, the default model's shapes as the shipped GGUF stores them (Q4_1
layers, a Q8_0 LM head), on every kernel family this CPU runs, fp32 and int8 activations, the families
alternating, best of --rounds x 20 calls each: a decode step's products as the kernels give them hot in cache.
"""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks.bench_bf16_cpu import standard_batch, throughput, tpot_ms  # noqa: E402

TEXT = ("The lighthouse stood at the end of the long stone pier, and every night for forty years the keeper "
        "climbed its narrow stairs to light the lamp. Ships passing in the dark relied on its steady beam to find "
        "the harbour, and the people of the town said that as long as the light burned, no one would be lost at sea. "
        "When the storm of that winter came, the waves broke over the pier and the wind tore at the windows, but "
        "the keeper kept the lamp burning until morning, and the fishing boats came home one by one.")


def arms(q8_gguf: str | None) -> dict[str, dict]:
    from stagemesh.core.default_model import gguf_path

    table = {"fp32": dict(dtype="float32"), "bf16": dict(dtype="bfloat16"),
             "gguf-q4_1": dict(quantization="gguf", gguf_file=str(gguf_path())),
             "gguf-q4_1-f32scales": dict(quantization="gguf", gguf_file=str(gguf_path())),
             "w8a16": dict(quantization="w8a16"), "w8a8": dict(quantization="w8a8")}
    if q8_gguf:
        table["gguf-q8_0"] = dict(quantization="gguf", gguf_file=q8_gguf)
    return table


def widen_scales(engine) -> None:
    """Every quantised weight of the engine in place with fp32 scales and mins (a new QuantizedWeight in the
    layer's place: the layer plans see the change)."""
    from stage_worker.quant_weight import QuantizedWeight

    for runner in engine.runners:
        for module in list(runner.model.modules()):
            w = module._modules.get("weight")
            if isinstance(w, QuantizedWeight):
                module.weight = QuantizedWeight(w.qs, w.scales, w.mins, w.kind, w.int8_activations,
                                                compact_scales=False)


def score(engine, ids: list[int]) -> tuple[float, list[int]]:
    """Teacher-forced: the mean negative log-likelihood of the text and the top token at each position."""
    from stagemesh.core.sampling_params import SamplingParams

    entries = []
    for out in engine.stream(ids, SamplingParams(max_tokens=1, prompt_logprobs=1)):
        entries += out.prompt_logprobs
    return -sum(e.logprob for e in entries) / len(entries), [e.top_token_ids[0] for e in entries]


def llama_bench(binary: str, gguf: str, threads: int, tokens: int) -> float:
    """llama.cpp's batch-1 generation on the same GGUF and threads: its TPOT in ms."""
    out = subprocess.run([binary, "-m", gguf, "-t", str(threads), "-p", "0", "-n", str(tokens), "-r", "1", "-o", "csv"],
                         capture_output=True, text=True, check=True).stdout
    tps = float(re.findall(r'"(\d+\.\d+)","[\d.]+"\s*$', out.strip(), re.M)[-1])
    return 1e3 / tps


@contextlib.contextmanager
def family_of(arm: str):
    """The quantised products of ARM@FAMILY on FAMILY while it runs; other arms on this CPU's best."""
    from kernels import cpu_ops

    cpu_ops.pin_quant_family(arm.split("@")[1] if "@" in arm else None)
    try:
        yield
    finally:
        cpu_ops.pin_quant_family(None)


def products(args) -> None:
    from kernels import cpu_ops, isa
    from kernels import quant_reference as ref
    from stage_worker.cpu_isa import cpu_flags, describe_isa
    from stagemesh.core.default_model import default_model_dir
    from stagemesh.core.model_config import ModelConfig

    cfg = ModelConfig.from_path(default_model_dir())
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    shapes = {"qkv": (cfg.num_attention_heads * d + 2 * cfg.num_key_value_heads * d, h, 4),
              "o": (h, cfg.num_attention_heads * d, 4), "gate_up": (2 * i, h, 4), "down": (h, i, 4),
              "lm_head": (cfg.vocab_size, h, 8)}
    runs = {f.name for f in isa.running(cpu_flags())}
    module = cpu_ops.load()
    built = {"avx2": True, "avx512": module.quant_avx512_available(),
             "avx512_vnni": module.quant_avx512_available() and module.int8_vnni_available(),
             "avx512_bf16": module.quant_bf16_available()}
    families = [f for f in isa.KERNELS["quant"] if f in runs and built[f]]
    arms = [(f, False) for f in families if f != "avx512_vnni" or "avx512" not in families]
    # avx512's int8 products are avx2's, avx512_bf16's avx512_vnni's
    arms += [(f, True) for f in families if f not in ("avx512", "avx512_bf16")]
    g = torch.Generator().manual_seed(0)
    step = {arm: 0.0 for arm in arms}
    print(f"products alone, {args.threads} threads, {args.rows} rows of x, us per call (best); "
          f"{describe_isa(cpu_flags())}")
    for name, (n, k, bits) in shapes.items():
        scales = torch.rand(n, k // 32, generator=g) * 0.02
        if bits == 4:
            qs, mins = ref.pack_4bit(torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)), -scales
        else:
            qs, mins = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8), None
        x = torch.randn(args.rows, k, generator=g)
        best = {arm: float("inf") for arm in arms}
        for _ in range(args.rounds):
            for family, a8 in arms:
                for _ in range(3):
                    cpu_ops.quant_linear(x, qs, scales, mins, None, a8, family)
                start = time.perf_counter()
                for _ in range(20):
                    cpu_ops.quant_linear(x, qs, scales, mins, None, a8, family)
                best[(family, a8)] = min(best[(family, a8)], (time.perf_counter() - start) / 20 * 1e6)
        for arm in arms:
            step[arm] += best[arm] * (1 if name == "lm_head" else cfg.num_hidden_layers)
        print(f"{name:8s} {n:6d} x {k:5d} q{bits}: " + "  ".join(
            f"{f}{' a8' if a8 else ''} {best[(f, a8)]:7.1f}" for f, a8 in arms))
    print("a step's products (layers x 4 + LM head), ms: " + "  ".join(
        f"{f}{' a8' if a8 else ''} {v / 1e3:.2f}" for (f, a8), v in step.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64, help="batch-1 output tokens")
    parser.add_argument("--batch", type=int, default=32, help="concurrent requests (prompts 16-256, outputs 16-128)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--llama-bench", default=None, help="llama.cpp's llama-bench, run on the same GGUFs")
    parser.add_argument("--q8-gguf", default=None, help="a Q8_0 GGUF of the default model (gguf-q8_0 arm)")
    parser.add_argument("--arms", default=None, help="comma-separated subset of the arms")
    parser.add_argument("--products", action="store_true", help="time the products alone per kernel family")
    parser.add_argument("--rows", type=int, default=1, help="--products: rows of x (1: batch-1 decode)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.products:
        return products(args)
    from transformers import AutoTokenizer

    from stagemesh.entry.local_engine import LocalEngine
    from stage_worker.cpu_isa import cpu_flags, describe_isa
    from stagemesh.core.default_model import default_model_dir, gguf_path

    model_dir = default_model_dir()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompt_ids = tokenizer.encode("Write a short story about a lighthouse keeper.")
    text_ids = tokenizer.encode(TEXT)
    prompts, outputs = standard_batch(args.batch)
    table = arms(args.q8_gguf)
    if args.arms:
        table = {name: table[name.split("@")[0]] for name in args.arms.split(",")}
    engines = {name: LocalEngine.of(model_dir, **kw) for name, kw in table.items()}
    for name, engine in engines.items():
        if name.split("@")[0].endswith("-f32scales"):
            widen_scales(engine)
    figures = {name: {"tpot": [], "tput": []} for name in engines}
    llama = {"q4_1": [], "q8_0": []}
    try:
        quality = {}
        for name, engine in engines.items():
            with family_of(name):
                quality[name] = score(engine, text_ids)
                tpot_ms(engine, prompt_ids, 4)  # warm-up
        for _ in range(args.rounds):
            for name, engine in engines.items():
                with family_of(name):
                    figures[name]["tpot"].append(tpot_ms(engine, prompt_ids, args.tokens))
                    figures[name]["tput"].append(throughput(engine, prompts, outputs))
            if args.llama_bench:
                llama["q4_1"].append(llama_bench(args.llama_bench, str(gguf_path()), args.threads, args.tokens))
                if args.q8_gguf:
                    llama["q8_0"].append(llama_bench(args.llama_bench, args.q8_gguf, args.threads, args.tokens))
    finally:
        for engine in engines.values():
            engine.close()
    report(args, figures, quality, llama, describe_isa(cpu_flags()))


def report(args, figures, quality, llama, isa: str) -> None:
    med = {n: {k: statistics.median(v) for k, v in f.items()} for n, f in figures.items()}
    base_nll, base_top = quality.get("fp32", next(iter(quality.values())))
    print(f"default model in-process, {args.threads} threads, {args.rounds} rounds (medians; rounds in brackets); "
          f"{isa}")
    for n, f in figures.items():
        nll, top = quality[n]
        agree = sum(a == b for a, b in zip(top, base_top)) / len(base_top)
        print(f"{n:10s}: batch-1 TPOT {med[n]['tpot']:6.1f} ms [{', '.join(f'{x:.1f}' for x in f['tpot'])}]  "
              f"batch-{args.batch} {med[n]['tput']:6.1f} tok/s [{', '.join(f'{x:.1f}' for x in f['tput'])}]  "
              f"perplexity {math.exp(nll):.3f} (fp32 {math.exp(base_nll):.3f}), top-1 agreement {agree:.1%}")
    for fmt, values in llama.items():
        if values:
            ours = med.get(f"gguf-{fmt}", {}).get("tpot")
            ratio = (f"; gguf-{fmt} / llama.cpp TPOT {ours / statistics.median(values):.2f}x (target <= 1)"
                     if ours else "")
            print(f"llama.cpp {fmt}: batch-1 TPOT {statistics.median(values):6.1f} ms "
                  f"[{', '.join(f'{x:.1f}' for x in values)}]{ratio}")


if __name__ == "__main__":
    main()
