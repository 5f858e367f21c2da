"""Gemma 3 at long context: the hybrid KV cache manager (stagemesh.core.kv_groups: a block table per group of
layers, sliding groups' blocks freed out of the window) against the all-global cache
(--disable-hybrid-kv-cache-manager), the same model, the same --kv-cache-memory, in-process, arms in turn.

A random Gemma 3 text model is written first: Gemma-3-1B's attention (4 heads, 1 KV head of 256, a window of
512, five local layers to one global) at a smaller width and depth by default (--layers, --hidden), bf16.

Figures per arm:
- the tokens the memory holds (the replica's "KV cache size"), and how many of the long requests fit at once;
- the wall time and output tokens per second of --requests requests of --prompt tokens each, --output tokens
  out, all sent at once (the all-global arm runs fewer at a time, preempting);
- batch 1's time per output token after one --prompt-token prompt (both read only the window on local layers).

    .venv/bin/python benchmarks/bench_hybrid_kv.py [--rounds 3] [--prompt 2048] [--requests 6] [--output 128]
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks.bench_bf16_cpu import tpot_ms  # noqa: E402

ARMS = {"hybrid (default)": False, "all-global (--disable-hybrid-kv-cache-manager)": True}


def write_model(path: Path, layers: int, hidden: int, window: int) -> Path:
    """A random Gemma 3 text model (bf16 safetensors) of Gemma-3-1B's attention at this depth and width."""
    from transformers import AutoModelForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(vocab_size=8192, hidden_size=hidden, intermediate_size=4 * hidden,
                              num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                              sliding_window=window, max_position_embeddings=32768, query_pre_attn_scalar=256,
                              layer_types=[("full_attention" if (i + 1) % 6 == 0 else "sliding_attention")
                                           for i in range(layers)])
    config.architectures = ["Gemma3ForCausalLM"]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(path, safe_serialization=True)
    return path


def isa() -> str:
    from kernels.isa import cpu_flags

    wanted = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8")
    return f"{platform.machine()} {os.cpu_count()} cores, " + " ".join(f for f in wanted if f in cpu_flags())


def engine_of(model: Path, args, disable: bool):
    from stagemesh.entry.local_engine import LocalEngine

    return LocalEngine.of(model, dtype="bfloat16", kv_cache_memory=args.kv_cache_memory,
                          max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.prompt + args.output,
                          disable_hybrid_kv_cache_manager=disable, skip_server_warmup=True)


def batch_run(engine, prompts: list[list[int]], output: int) -> tuple[float, float]:
    """(wall seconds, output tokens per second) of the requests sent at once."""
    from stagemesh.core.sampling_params import SamplingParams

    start = time.perf_counter()
    engine.generate(prompts, SamplingParams(max_tokens=output, ignore_eos=True))
    seconds = time.perf_counter() - start
    return seconds, len(prompts) * output / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=640)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--prompt", type=int, default=2048)
    parser.add_argument("--output", type=int, default=128)
    parser.add_argument("--requests", type=int, default=6)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--kv-cache-memory", type=int, default=0,
                        help="bytes per stage (default: what the all-global cache needs for 2 of the requests)")
    args = parser.parse_args()
    torch.manual_seed(0)
    per_token_all_global = 2 * args.layers * 256 * 2  # one KV head of 256, bf16, k and v
    if not args.kv_cache_memory:
        args.kv_cache_memory = 2 * (args.prompt + args.output + 16) * per_token_all_global
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(10, 8000, (args.prompt,), generator=gen).tolist() for _ in range(args.requests)]
    print(f"machine: {isa()}; torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"model: random Gemma 3 text, {args.layers} layers (5 local to 1 global), hidden {args.hidden}, 4 heads, "
          f"1 KV head of 256, window {args.window}, bf16; --kv-cache-memory {args.kv_cache_memory:,} bytes, "
          f"--max-num-batched-tokens {args.max_num_batched_tokens}")
    print(f"workload: {args.requests} requests of {args.prompt} prompt tokens, {args.output} out, at once; batch 1 "
          f"after a {args.prompt}-token prompt")
    results: dict[str, dict[str, list[float]]] = {arm: {"wall": [], "tps": [], "tpot": []} for arm in ARMS}
    held: dict[str, tuple[int, int]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = write_model(Path(tmp) / "gemma3", args.layers, args.hidden, args.window)
        with engine_of(model, args, False) as engine:  # (the process's first engine pays its one-time costs)
            batch_run(engine, [p[:256] for p in prompts[:2]], 4)
        for r in range(args.rounds):
            for arm, disable in ARMS.items():
                with engine_of(model, args, disable) as engine:
                    config = engine.driver.epochs.scheduler.config
                    held[arm] = (config.kv_cache_tokens,
                                 config.num_kv_blocks // config.kv_blocks_for(args.prompt + args.output))
                    wall, tps = batch_run(engine, prompts, args.output)
                    tpot = tpot_ms(engine, prompts[0], args.output)
                results[arm]["wall"].append(wall)
                results[arm]["tps"].append(tps)
                results[arm]["tpot"].append(tpot)
                print(f"  round {r + 1} {arm}: {wall:.1f} s, {tps:.1f} out tok/s, batch-1 TPOT {tpot:.1f} ms",
                      flush=True)
    print()
    print("| arm | KV tokens held | long requests at once | batch wall s | out tok/s | batch-1 TPOT ms |")
    print("|---|---|---|---|---|---|")
    for arm in ARMS:
        m = {k: statistics.median(v) for k, v in results[arm].items()}
        print(f"| {arm} | {held[arm][0]:,} | {held[arm][1]} | {m['wall']:.1f} | {m['tps']:.1f} | {m['tpot']:.1f} |")
    hybrid, plain = ARMS

    def ratio(key: str) -> float:
        return statistics.median(results[hybrid][key]) / statistics.median(results[plain][key])

    print(f"\nhybrid / all-global: {held[hybrid][0] / held[plain][0]:.2f}x the tokens, {ratio('tps'):.2f}x the "
          f"output tokens per second, batch-1 TPOT {ratio('tpot'):.2f}x")


if __name__ == "__main__":
    main()
