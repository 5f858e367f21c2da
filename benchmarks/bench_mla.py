"""Multi-head latent attention both ways on a small random DeepSeek-V3 (V3's per-head widths: kv_lora_rank 512,
qk_nope 128, qk_rope 64, v 128; fewer heads and layers, dense MLPs: the experts are not what is measured), one
stage in-process: decode tokens/s with decode rows absorbed (W_UK into the query, W_UV after: stagemesh's way; on
the C++ kernel, and on the torch reference) against expanded (the context's latents through kv_b_proj every step),
and a prompt's prefill time expanded (stagemesh's way) against absorbed. The ways alternate for --rounds rounds;
medians are compared (a shared machine's bursts hit them all).

    .venv/bin/python benchmarks/bench_mla.py [--dtype bfloat16] [--batch 8] [--context 1024] [--steps 16]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import kernels  # noqa: E402
from kernels import mla_reference  # noqa: E402

from stagemesh.core.model_config import ModelConfig  # noqa: E402
from stagemesh.core.sampling_params import SamplingParams  # noqa: E402
from stagemesh.core.step import NewSequence, ScheduledChunk, StepBatch  # noqa: E402
from stage_worker.mla import MLAttention  # noqa: E402
from stage_worker.runner import StageRunner  # noqa: E402
from stage_worker.weights import init_random_weights  # noqa: E402

BLOCK = 16


def small_v3(heads: int, layers: int) -> ModelConfig:
    from transformers import DeepseekV3Config

    cfg = DeepseekV3Config(hidden_size=1024, intermediate_size=2048, moe_intermediate_size=512,
                           num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                           vocab_size=8192, n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
                           first_k_dense_replace=layers, q_lora_rank=512, kv_lora_rank=512, qk_nope_head_dim=128,
                           qk_rope_head_dim=64, v_head_dim=128, max_position_embeddings=8192)
    return ModelConfig.from_dict(cfg.to_dict())


class Batch:
    """`batch` sequences of `context` prompt tokens through one stage, then decode steps."""

    def __init__(self, runner: StageRunner, batch: int, context: int):
        self.runner, self.batch, self.context = runner, batch, context
        self.step, self.pos = 0, context
        self.blocks = -(-(context + 4096) // BLOCK)  # each sequence's room

    def prefill(self, seq: int = 0) -> float:
        """One prompt's prefill (its own sequence id), timed."""
        prompt = [(7 * i + seq) % 8000 + 3 for i in range(self.context)]
        first = seq * self.blocks
        new = NewSequence(seq, prompt, SamplingParams(max_tokens=1 << 20, ignore_eos=True))
        chunk = ScheduledChunk(seq, prompt, 0, list(range(first, first + -(-self.context // BLOCK))), True)
        start = time.perf_counter()
        self.runner.execute(StepBatch(self.step, [new], [chunk]))
        self.step += 1
        return time.perf_counter() - start

    def decode(self, steps: int) -> float:
        """tokens/s of `steps` decode steps of every sequence."""
        start = time.perf_counter()
        for _ in range(steps):
            chunks = []
            for s in range(self.batch):
                grow = self.pos % BLOCK == 0
                chunks.append(ScheduledChunk(s, [5], self.pos, [s * self.blocks + self.pos // BLOCK] if grow else [],
                                             True))
            self.runner.execute(StepBatch(self.step, [], chunks))
            self.step, self.pos = self.step + 1, self.pos + 1
        return self.batch * steps / (time.perf_counter() - start)


def set_way(model, absorb_decode: bool, absorb_prefill: bool) -> None:
    for m in model.modules():
        if isinstance(m, MLAttention):
            m.absorb_decode, m.absorb_prefill = absorb_decode, absorb_prefill


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    cfg = small_v3(a.heads, a.layers)
    runner = StageRunner.of(None, 0, cfg.num_hidden_layers, config=cfg, load=False, dtype=a.dtype)
    init_random_weights(runner.model)
    bench = Batch(runner, a.batch, a.context)
    runner.allocate_kv_cache(a.batch * bench.blocks + 2 * bench.blocks)
    for s in range(a.batch):
        bench.prefill(s)
    # absorbed-torch: the absorbed way on the torch reference kernel instead of the C++ one (mla_decode.cpp)
    decode: dict[str, list[float]] = {"absorbed": [], "absorbed-torch": [], "expanded": []}
    cpp_kernel = kernels.mla_attention_rows
    prefill: dict[str, list[float]] = {"expanded": [], "absorbed": []}
    spare = a.batch  # a sequence id whose blocks the prefills reuse (finished each time)
    for _ in range(a.rounds):
        for way in decode:
            set_way(runner.model, way != "expanded", False)
            kernels.mla_attention_rows = mla_reference.mla_attention_rows if way == "absorbed-torch" else cpp_kernel
            decode[way].append(bench.decode(a.steps))
        kernels.mla_attention_rows = cpp_kernel
        for way in prefill:
            set_way(runner.model, True, way == "absorbed")
            prefill[way].append(bench.prefill(spare))
            runner.execute(StepBatch(bench.step, finished_seq_ids=[spare]))
            bench.step += 1
    med = {way: statistics.median(v) for way, v in {**{f"decode {k}": x for k, x in decode.items()},
                                                     **{f"prefill {k}": x for k, x in prefill.items()}}.items()}
    print(f"small DeepSeek-V3, {a.heads} heads, {a.layers} layers, {a.dtype}, {a.threads} threads: batch {a.batch} "
          f"at {a.context}+ tokens of context, {a.steps} decode steps, {a.rounds} rounds")
    for way in decode:
        print(f"decode {way:14s}: {med[f'decode {way}']:8.1f} tokens/s "
              f"(rounds: {', '.join(f'{x:.1f}' for x in decode[way])})")
    print(f"decode absorbed / expanded: {med['decode absorbed'] / med['decode expanded']:.2f}x; the absorbed way "
          f"on the C++ kernel / on the torch reference: {med['decode absorbed'] / med['decode absorbed-torch']:.2f}x")
    for way in prefill:
        print(f"prefill {way:8s}: {1000 * med[f'prefill {way}']:8.1f} ms for {a.context} tokens "
              f"(rounds: {', '.join(f'{1000 * x:.1f}' for x in prefill[way])})")
    print(f"prefill expanded is {med['prefill absorbed'] / med['prefill expanded']:.2f}x faster than absorbed")


if __name__ == "__main__":
    main()
