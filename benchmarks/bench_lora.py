"""What multi-LoRA costs (issue 46): the in-process engine on the same model and workload, arms alternating.

Arms:
- base: no --enable-lora;
- lora-idle: --enable-lora with adapters loaded, every request on the base model (the Python layer path that
  LoRALinear forces, and nothing else);
- one: every request on one adapter;
- four: requests spread over four adapters (--max-loras 4);
- sixteen: requests spread over sixteen adapters, --max-loras 16 (--slots16 4: at most four run at once, the
  rest wait their turn and slots change adapters as they go).

The adapters are random PEFT adapters of rank --rank on q/k/v/o and the MLP projections. The workload is
--num requests at once, each a --prompt-len token prompt and --output-len tokens out (ignore_eos), or one at a
time with --batch1. Prints each round, then the median output tok/s of each arm and its ratio to base, with this
machine's ISA.

    .venv/bin/python benchmarks/bench_lora.py [--model DIR] [--dtype float32] [--rounds 3] [--batch1]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1]))

ARMS = ("base", "lora-idle", "one", "four", "sixteen")


def make_adapters(model_dir: str, root: Path, rank: int, count: int) -> dict[str, Path]:
    import torch
    from safetensors.torch import save_file

    from stagemesh.core.lora import TARGET_MODULES
    from stagemesh.core.model_config import ModelConfig
    from stage_worker.lora import shapes

    cfg = ModelConfig.from_path(model_dir)
    out = {}
    for i in range(count):
        gen, tensors = torch.Generator().manual_seed(i), {}
        for layer in range(cfg.num_hidden_layers):
            for name in TARGET_MODULES:
                out_f, in_f = shapes(cfg)[name]
                block = "mlp" if name in ("gate_proj", "up_proj", "down_proj") else "self_attn"
                key = f"base_model.model.model.layers.{layer}.{block}.{name}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(rank, in_f, generator=gen) * 0.01
                tensors[f"{key}.lora_B.weight"] = torch.randn(out_f, rank, generator=gen) * 0.01
        path = root / f"a{i}"
        path.mkdir()
        save_file(tensors, str(path / "adapter_model.safetensors"))
        (path / "adapter_config.json").write_text(json.dumps(
            {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGET_MODULES)}))
        out[f"a{i}"] = path
    return out


def run_arm(arm: str, model_dir: str, adapters: dict[str, Path], args) -> float:
    """Output tokens per second of one arm's workload (engine built outside the timing)."""
    from stagemesh.core.sampling_params import SamplingParams
    from stagemesh.entry.local_engine import LocalEngine

    lora = {} if arm == "base" else dict(lora_modules=[f"{n}={p}" for n, p in adapters.items()],
                                         max_loras=args.slots16 if arm == "sixteen" else 4,
                                         max_lora_rank=max(16, args.rank), max_cpu_loras=len(adapters))
    names = {"base": [""], "lora-idle": [""], "one": ["a0"], "four": ["a0", "a1", "a2", "a3"],
             "sixteen": list(adapters)}[arm]
    prompts = [[100 + (i * 7 + j) % 20000 for j in range(args.prompt_len)] for i in range(args.num)]
    sampling = SamplingParams(max_tokens=args.output_len, ignore_eos=True)
    with LocalEngine.of(model_dir, dtype=args.dtype, enable_prefix_caching=False, **lora) as engine:
        engine.generate(prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True), [names[0]] * 2)  # warm
        start = time.perf_counter()
        if args.batch1:
            for i, p in enumerate(prompts):
                engine.generate([p], sampling, [names[i % len(names)]])
        else:
            engine.generate(prompts, sampling, [names[i % len(names)] for i in range(len(prompts))])
        return args.num * args.output_len / (time.perf_counter() - start)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model directory (default: the embedded model)")
    p.add_argument("--dtype", default=None)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--num", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--batch1", action="store_true", help="one request at a time")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--slots16", type=int, default=16, help="--max-loras of the sixteen arm")
    args = p.parse_args()
    from stagemesh.core.default_model import default_model_dir
    from stage_worker.cpu_isa import cpu_flags, describe_isa

    model_dir = args.model or str(default_model_dir())
    if args.batch1:
        args.num = min(args.num, 4)
    print(f"multi-LoRA cost, in-process engine, {model_dir}, dtype {args.dtype or 'auto'}, rank {args.rank}, "
          f"{args.num} x {args.prompt_len} in / {args.output_len} out{' one at a time' if args.batch1 else ''}; "
          f"{describe_isa(cpu_flags())}")
    results: dict[str, list[float]] = {arm: [] for arm in ARMS}
    with tempfile.TemporaryDirectory() as tmp:
        adapters = make_adapters(model_dir, Path(tmp), args.rank, 16)
        for r in range(args.rounds):
            order = ARMS if r % 2 == 0 else tuple(reversed(ARMS))
            for arm in order:
                results[arm].append(run_arm(arm, model_dir, adapters, args))
            print(f"round {r + 1}: " + ", ".join(f"{arm} {results[arm][-1]:.1f}" for arm in ARMS) + " tok/s")
    base = statistics.median(results["base"])
    for arm in ARMS:
        median = statistics.median(results[arm])
        print(f"{arm:>10}: {median:8.1f} tok/s  ({median / base:.2f}x base)")


if __name__ == "__main__":
    main()
