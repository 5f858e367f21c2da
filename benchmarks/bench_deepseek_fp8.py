"""DeepSeek-V3 in block FP8 (as the released checkpoint: weight_scale_inv per 128x128 block, written by
tests/quant_checkpoints.py) against bf16 on CPU: a small random V3 with V3's head widths (kv_lora_rank 512,
qk_nope 128, qk_rope 64, v 128), q_lora_rank, a dense first layer, then routed experts (16, top-2, grouped gate) and
a shared expert. Batch-1 decode TPOT and the process's peak RSS, each arm in its own process, alternating
(bench_quant_formats' harness: every arm runs with bf16 activations and a small KV cache).

    .venv/bin/python benchmarks/bench_deepseek_fp8.py [--rounds 2] [--tokens 32] [--threads 2]
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


def small_v3(path: Path) -> Path:
    from transformers import DeepseekV3Config

    from tiny_models import save_random_model

    cfg = DeepseekV3Config(hidden_size=1024, intermediate_size=2048, moe_intermediate_size=512, num_hidden_layers=4,
                           num_attention_heads=8, num_key_value_heads=8, vocab_size=8192, n_routed_experts=16,
                           num_experts_per_tok=2, n_group=4, topk_group=2, n_shared_experts=1,
                           first_k_dense_replace=1, q_lora_rank=512, kv_lora_rank=512, qk_nope_head_dim=128,
                           qk_rope_head_dim=64, v_head_dim=128, max_position_embeddings=4096, tie_word_embeddings=False)
    cfg.architectures = ["DeepseekV3ForCausalLM"]
    return save_random_model(path, cfg)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    from benchmarks.bench_quant_formats import print_table, run_arms
    from quant_checkpoints import write_quantized
    from stage_worker.cpu_isa import cpu_flags, describe_isa

    print(describe_isa(cpu_flags()))
    with tempfile.TemporaryDirectory() as tmp:
        base = small_v3(Path(tmp) / "bf16")
        fp8 = write_quantized(base, Path(tmp) / "fp8", "fp8-block", block=128)[0]
        print_table(run_arms({"bf16": str(base), "fp8-block": str(fp8)}, args.rounds, args.tokens, args.threads))


if __name__ == "__main__":
    main()
