"""The int8-activation fast path against its accuracy contract (issue 57), on the default model: teacher-forced
over an evaluation text, the KL divergence of the fast path from the weight-only (exact) path, against the KL
divergence the weight quantization itself adds to the bf16 model, and the fast path's top-1 agreement with the
exact path. The contract: ratio <= 0.1 and agreement >= 99%.

Formats: the embedded model's GGUF Q4_1 (its bf16 model: the same file dequantised, the only one there is), and
a compressed-tensors INT8 W8A8 checkpoint of the default model written here (its bf16 model: the default model).
Also the products' speed, exact against int8, on the default model's shapes (--products in bench_quant_cpu.py
has every family).

    .venv/bin/python benchmarks/bench_quant_contract.py [--tokens 512] [--threads 2]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import torch  # noqa: E402

def runner(model_dir, **kw):
    from stage_worker.runner import StageRunner
    from stagemesh.core.model_config import ModelConfig

    layers = ModelConfig.from_path(model_dir).num_hidden_layers
    return StageRunner.of(model_dir, 0, layers, **kw)


def measure(name: str, bf16_dir, quant_kw: dict, ids: list[int]) -> dict:
    from quant_contract import MAX_KL_RATIO, MIN_TOP1, kl, set_int8_activations, teacher_forced_logits, top1

    reference = teacher_forced_logits(runner(bf16_dir, dtype="bfloat16"), ids)
    quantised = runner(quant_kw.pop("model_dir"), dtype="float32", **quant_kw)
    exact = teacher_forced_logits(quantised, ids)
    count = set_int8_activations(quantised.model, True)
    fast = teacher_forced_logits(quantised, ids)
    kl_weights, kl_fast = kl(reference, exact), kl(exact, fast)
    ratio, agree = kl_fast / kl_weights, top1(exact, fast)
    ok = ratio <= MAX_KL_RATIO and agree >= MIN_TOP1
    print(f"{name}: {len(ids) - 1} positions, {count} linears; KL(bf16 || exact) {kl_weights:.3e}, "
          f"KL(exact || int8) {kl_fast:.3e}, ratio {ratio:.3f} (<= {MAX_KL_RATIO}), top-1 agreement {agree:.4f} "
          f"(>= {MIN_TOP1}): contract {'MET' if ok else 'NOT MET'}")
    return dict(ratio=ratio, agree=agree, ok=ok)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=512, help="positions of the evaluation text, at most")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    from quant_checkpoints import write_quantized
    from quant_contract import EVAL_TEXT
    from stagemesh.core.default_model import default_model_dir, gguf_path
    from stage_worker.cpu_isa import cpu_flags, describe_isa

    base = default_model_dir()
    print(describe_isa(cpu_flags()))
    ids = AutoTokenizer.from_pretrained(base).encode(EVAL_TEXT)[:args.tokens]
    measure("GGUF Q4_1 (embedded)", base, dict(model_dir=base, quantization="gguf", gguf_file=str(gguf_path())), ids)
    with tempfile.TemporaryDirectory() as tmp:
        w8a8, _ = write_quantized(base, tmp, "ct-int8")
        measure("compressed-tensors INT8 W8A8", base, dict(model_dir=w8a8), ids)


if __name__ == "__main__":
    main()
