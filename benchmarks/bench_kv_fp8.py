"""--kv-cache-dtype fp8 against the auto cache (the model's dtype), the embedded model in-process, same run:

- accuracy: the KL divergence of each position's next-token distribution from the auto cache's, teacher-forced over
  a slice of text (benchmarks/bench_quant_cpu.py's and one more paragraph, prefilled in chunks of 64 so that every
  chunk reads the cache the earlier ones wrote), and top-1 agreement; per model dtype (fp32, bf16) and per fp8
  arm: e4m3 with the scales of 1.0 (the embedded model's checkpoint has none), e4m3 with --calculate-kv-scales, and
  e5m2. For scale, the KL of bf16 weights (auto cache) against fp32;
- capacity: the tokens --kv-cache-memory holds;
- decode speed (bf16, the CPU's default): batch-1 time per output token after a 1,500-token prompt, and the
  output tokens per second of the standard batch (32 requests, prompts 16-256, outputs 16-128), arms in turn each
  round;
- the decode attention alone (this CPU's family kernel, the model's heads, 32 rows of 1,000-1,500 positions):
  a bf16 cache, an fp8 cache read by the kernel (dequantised in registers), and an fp8 cache converted to bf16 at
  read (the blocks the batch reads, then the bf16 kernel): which of the two is faster.

    .venv/bin/python benchmarks/bench_kv_fp8.py [--rounds 3] [--tokens 32] [--batch 32] [--threads N] \
        [--parts accuracy,capacity,attention,speed]
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks.bench_bf16_cpu import standard_batch, throughput, tpot_ms  # noqa: E402
from benchmarks.bench_quant_cpu import TEXT  # noqa: E402

MORE = ("In the spring a new keeper arrived from the city. She had never seen the sea, and for the first weeks she "
        "wrote down everything the old keeper told her: how to trim the wick, how to wind the clockwork that turned "
        "the lens, how to read the sky for weather coming in from the west. He showed her the logbook, in which "
        "every night of forty years was written in the same careful hand, the wind, the sea, the ships that passed. "
        "On her last night as his apprentice he let her light the lamp alone, and he watched from the rocks below as "
        "the beam swept out across the water, steady and bright, exactly as it always had.")
ARMS = {"fp8 (e4m3, scales 1.0)": dict(kv_cache_dtype="fp8"),
        "fp8 (e4m3, calculated)": dict(kv_cache_dtype="fp8", calculate_kv_scales=True),
        "fp8_e5m2 (scales 1.0)": dict(kv_cache_dtype="fp8_e5m2")}


def all_logits(runner, ids: list[int], chunk: int = 64) -> torch.Tensor:
    """Every position's logits [len(ids), vocab] fp32, the text prefilled in chunks through the runner's cache."""
    from stage_worker.attention_metadata import AttentionMetadata

    runner.allocate_kv_cache(math.ceil(len(ids) / runner.block_size))
    table = torch.arange(runner.kv_caches[0][0].shape[0], dtype=torch.int32)[None]
    out = []
    with torch.inference_mode():
        for start in range(0, len(ids), chunk):
            end = min(start + chunk, len(ids))
            pos = torch.arange(start, end)
            meta = AttentionMetadata(positions=pos, slot_mapping=pos, block_tables=table,
                                     context_lens=torch.tensor([end], dtype=torch.int32),
                                     query_start_loc=torch.tensor([0, end - start], dtype=torch.int32))
            runner.kv_scales.arm()
            hidden = runner.model(torch.tensor(ids[start:end]), None, meta, runner.kv_caches)
            runner.kv_scales.settle()
            out.append(runner.model.compute_logits(hidden))
    return torch.cat(out)


def kl(base: torch.Tensor, other: torch.Tensor) -> tuple[float, float, float]:
    """Mean and max over positions of KL(base || other) in nats, and top-1 agreement."""
    p, q = base.log_softmax(-1), other.log_softmax(-1)
    per = (p.exp() * (p - q)).sum(-1)
    return float(per.mean()), float(per.max()), float((base.argmax(-1) == other.argmax(-1)).float().mean())


def accuracy(model_dir, ids: list[int]) -> None:
    from stage_worker.runner import StageRunner
    from stagemesh.core.model_config import ModelConfig

    n = ModelConfig.from_path(model_dir).num_hidden_layers
    bases = {}
    for dtype in ("float32", "bfloat16"):
        bases[dtype] = base = all_logits(StageRunner.of(model_dir, 0, n, dtype=dtype), ids)
        print(f"{dtype} weights, {len(ids)} positions: KL from the {dtype} (auto) cache, mean / max nats, top-1 "
              "agreement")
        for name, kw in ARMS.items():
            mean, top, agree = kl(base, all_logits(StageRunner.of(model_dir, 0, n, dtype=dtype, **kw), ids))
            print(f"  {name:24s} {mean:.5f} / {top:.4f}   {agree:6.1%}")
    mean, top, agree = kl(bases["float32"], bases["bfloat16"])
    print(f"  (for scale: bf16 weights against fp32, auto caches: {mean:.5f} / {top:.4f}   {agree:6.1%})")


def capacity(model_dir, memory: int) -> None:
    from stage_worker.kv_cache import num_kv_blocks_for_budget
    from stage_worker.runner import StageRunner
    from stagemesh.core.model_config import ModelConfig

    cfg = ModelConfig.from_path(model_dir)
    for dtype in ("float32", "bfloat16"):
        tokens = {}
        for kv in ("auto", "fp8"):
            r = StageRunner.of(model_dir, 0, cfg.num_hidden_layers, dtype=dtype, kv_cache_dtype=kv, load=False,
                               config=cfg)
            tokens[kv] = num_kv_blocks_for_budget(memory, r.kv_bytes_per_block) * r.block_size
        print(f"capacity, {dtype} model, --kv-cache-memory {memory / 2**20:.0f} MiB: auto {tokens['auto']:,} tokens, "
              f"fp8 {tokens['fp8']:,} tokens ({tokens['fp8'] / tokens['auto']:.2f}x)")


def speed(model_dir, args) -> None:
    from stagemesh.entry.local_engine import LocalEngine

    long_prompt = [100 + (i * 7919) % 40000 for i in range(1500)]
    prompts, outputs = standard_batch(args.batch)
    engines = {kv: LocalEngine.of(model_dir, dtype="bfloat16", kv_cache_dtype=kv) for kv in ("auto", "fp8")}
    figures = {kv: {"tpot": [], "tput": []} for kv in engines}
    try:
        for engine in engines.values():
            tpot_ms(engine, long_prompt[:200], 4)  # warm-up
        for _ in range(args.rounds):
            for kv, engine in engines.items():
                figures[kv]["tpot"].append(tpot_ms(engine, long_prompt, args.tokens))
                figures[kv]["tput"].append(throughput(engine, prompts, outputs))
    finally:
        for engine in engines.values():
            engine.close()
    med = {kv: {k: statistics.median(v) for k, v in f.items()} for kv, f in figures.items()}
    for kv, f in figures.items():
        print(f"bf16 model, {kv:4s} cache: batch-1 TPOT after 1,500 tokens {med[kv]['tpot']:6.1f} ms "
              f"[{', '.join(f'{x:.1f}' for x in f['tpot'])}]  batch-{args.batch} {med[kv]['tput']:6.1f} tok/s "
              f"[{', '.join(f'{x:.1f}' for x in f['tput'])}]")
    print(f"fp8 / auto: decode tok/s (batch 1, long context) {med['auto']['tpot'] / med['fp8']['tpot']:.2f}x, "
          f"batch-{args.batch} tok/s {med['fp8']['tput'] / med['auto']['tput']:.2f}x")


def attention(args) -> None:
    """Decode attention alone: a bf16 cache, fp8 read by the kernel, fp8 converted to bf16 at read."""
    from kernels import cpu_ops, kv_quant
    from kernels.cpu_ops import current_attention_family

    rows, bs, scales = 32, 16, (0.02, 0.01)
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(1000, 1500, (rows,), generator=g, dtype=torch.int32)
    per = [(int(n) + bs - 1) // bs for n in lens]
    blocks = torch.randperm(sum(per) + 8, generator=g)
    width = max(per)
    tables, used = torch.zeros(rows, width, dtype=torch.int32), 0
    for r, n in enumerate(per):
        tables[r, :n] = blocks[used:used + n]
        used += n
    shape = (blocks.numel(), bs, 3, 64)
    k, v = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    q = torch.randn(rows, 9, 64, generator=g).bfloat16()
    seqs = torch.arange(rows, dtype=torch.int32)
    kb, vb = k.bfloat16(), v.bfloat16()
    k8, v8 = kv_quant.quantize(k, scales[0], torch.float8_e4m3fn), kv_quant.quantize(v, scales[1], torch.float8_e4m3fn)
    family, module = current_attention_family(), cpu_ops.load()

    def bf16_cache():
        module.decode_attention(q, kb, vb, tables, seqs, lens, 0.125, family)

    def fp8_in_kernel():
        module.decode_attention(q, k8, v8, tables, seqs, lens, 0.125, family, *scales)

    def fp8_converted_at_read():  # the batch's blocks widened to bf16, then the bf16 kernel on them
        ids = tables.flatten().unique().long()
        remap = torch.zeros(shape[0], dtype=torch.int32)
        remap[ids] = torch.arange(len(ids), dtype=torch.int32)
        kc = kv_quant.dequantize(k8.index_select(0, ids), scales[0], torch.bfloat16)
        vc = kv_quant.dequantize(v8.index_select(0, ids), scales[1], torch.bfloat16)
        module.decode_attention(q, kc, vc, remap[tables.long()], seqs, lens, 0.125, family)

    arms = {"bf16 cache": bf16_cache, "fp8, dequantised in the kernel": fp8_in_kernel,
            "fp8, converted to bf16 at read": fp8_converted_at_read}
    times: dict[str, list[float]] = {name: [] for name in arms}
    for _ in range(args.rounds * 5):
        for name, fn in arms.items():
            start = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - start) * 1e6)
    base = min(times["bf16 cache"])
    print(f"decode attention, {family} family, {rows} rows of {int(lens.min())}-{int(lens.max())} positions, 9/3 "
          "heads of 64 (one layer; best / median of the rounds):")
    for name, t in times.items():
        print(f"  {name:32s} {min(t):8.0f} / {statistics.median(t):8.0f} us  ({min(t) / base:.2f}x the bf16 cache)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=32, help="batch-1 output tokens after the long prompt")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--memory", type=int, default=512 * 2**20, help="--kv-cache-memory of the capacity figure")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--parts", default="accuracy,capacity,attention,speed", help="which figures, in this order")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    from stagemesh.core.default_model import default_model_dir
    from stage_worker.cpu_isa import cpu_flags, describe_isa

    model_dir = default_model_dir()
    ids = AutoTokenizer.from_pretrained(model_dir).encode(TEXT + " " + MORE)
    print(f"default model in-process, {args.threads} threads; {describe_isa(cpu_flags())}")
    parts = {"accuracy": lambda: accuracy(model_dir, ids), "capacity": lambda: capacity(model_dir, args.memory),
             "attention": lambda: attention(args), "speed": lambda: speed(model_dir, args)}
    for part in args.parts.split(","):
        parts[part]()


if __name__ == "__main__":
    main()
