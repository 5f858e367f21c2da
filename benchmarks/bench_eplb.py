"""EPLB's balancedness (mean over max of the ranks' expert tokens) on a skewed mixture-of-experts workload:
`stagemesh serve -tp 2 --enable-expert-parallel` on a tiny Mixtral-shaped model whose router prefers two of
its eight experts (5 and 7), with --enable-eplb (two redundant copies, re-placed every --interval steps) and without.

    .venv/bin/python benchmarks/bench_eplb.py [--num-prompts 96 --interval 20]

The model (random weights, the default model's tokenizer) is built here: its router rows of experts 5 and 7
get the hidden states' mean direction added, so most tokens go to them. Both placements a run starts with hold
them on rank 1: the default one (experts 4-7 on rank 1) and EPLB's first (interleaved: 3, 5, 7 and copies of
0 and 1 on rank 1), so the gain after the first window is the rebalancing's. Without EPLB the balancedness comes
from the stage's per-expert token counts (/metrics) under the default placement (experts 0-3 on rank 0);
with EPLB from the stage's log: the first window runs EPLB's initial placement, later ones its rebalanced ones.
"""
from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import requests
import torch

from serve_process import free_port, start_serve, stop
from stagemesh.core.default_model import resolve_model
from stage_worker.eplb import balancedness


def skewed_model(path: Path) -> Path:
    import shutil

    from transformers import AutoTokenizer, MixtralConfig, MixtralForCausalLM

    base = resolve_model(None)
    tok = AutoTokenizer.from_pretrained(str(base))
    cfg = MixtralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=len(tok), max_position_embeddings=2048,
                        num_local_experts=8, num_experts_per_tok=2, tie_word_embeddings=False,
                        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    model = MixtralForCausalLM(cfg).eval()
    seen = {}
    hooks = [layer.mlp.gate.register_forward_hook(
        lambda m, args, out, i=i: seen.__setitem__(i, args[0].reshape(-1, 64).mean(0)))
        for i, layer in enumerate(model.model.layers)]
    with torch.no_grad():
        model(torch.randint(0, len(tok), (4, 64)))
        for i, layer in enumerate(model.model.layers):  # experts 5 and 7 take most tokens
            mean = seen[i] / seen[i].norm() ** 2
            layer.mlp.gate.weight[5] += 4 * mean
            layer.mlp.gate.weight[7] += 3 * mean
    for h in hooks:
        h.remove()
    model.save_pretrained(path, safe_serialization=True)
    for f in base.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            shutil.copy(f, path / f.name)
    return path


def run(model: Path, eplb: bool, args, log: Path) -> str:
    """Serve the model under the workload; stage 0's metrics page after it."""
    metrics = free_port()
    extra = ["--enable-eplb", "--eplb-config", f'{{"window_size": {args.interval}, "step_interval": {args.interval}, '
             '"num_redundant_experts": 2, "log_balancedness": true}'] if eplb else []
    serve, base = start_serve([str(model), "-tp", "2", "--enable-expert-parallel", "--threads", "1",
                               "--metrics-port", str(metrics), *extra], log)
    try:
        subprocess.run([sys.executable, "-m", "stagemesh", "bench", "--base-url", base, "--num-prompts",
                        str(args.num_prompts), "--max-concurrency", "8", "--input-len-range", "16:128",
                        "--output-len-range", "16:64", "--no-progress"], check=True, capture_output=True, timeout=1800)
        return requests.get(f"http://127.0.0.1:{metrics + 1}/metrics", timeout=10).text  # stage 0's page
    finally:
        stop(serve)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-prompts", type=int, default=96)
    p.add_argument("--interval", type=int, default=20, help="EPLB's window_size and step_interval, in steps")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="stagemesh-eplb-"))
    model = skewed_model(work / "model")
    page = run(model, False, args, work / "serve-plain.log")
    counts: dict[int, list[float]] = {}
    for line in page.splitlines():
        m = re.match(r'stagemesh:moe_expert_tokens_total\{(.*)\} (\S+)$', line)
        if m:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
            counts.setdefault(int(labels["layer"]), [0.0] * 8)[int(labels["expert"])] = float(m.group(2))
    default = [[0, 1, 2, 3], [4, 5, 6, 7]]
    plain = {layer: balancedness(load, default) for layer, load in sorted(counts.items())}
    run(model, True, args, work / "serve-eplb.log")
    text = (work / "serve-eplb.log").read_text()
    windows = [float(x) for x in re.findall(r"layer 0: EPLB over the last \d+ steps: balancedness ([\d.]+) (?:->|now,)",
                                            text)]
    # every layer's rebalances: (current placement's score, the new one's, applied)
    decisions = [(float(a), float(b), how == "->") for a, how, b in re.findall(
        r"layer \d+: EPLB over the last \d+ steps: balancedness ([\d.]+) (->|now,) ([\d.]+)", text)]
    print(f"skewed tiny Mixtral (8 experts, top-2), TP=2 expert parallel, {args.num_prompts} requests; logs in {work}")
    print("without EPLB, balancedness per layer: " + ", ".join(f"{layer} {b:.3f}" for layer, b in plain.items()))
    if len(windows) >= 2:
        print(f"with EPLB (2 redundant copies, every {args.interval} steps), layer 0: first window (its initial "
              f"placement) {windows[0]:.3f}, later windows (rebalanced) mean {statistics.mean(windows[1:]):.3f}, "
              f"min {min(windows[1:]):.3f} ({len(windows) - 1} windows)")
    else:
        print(f"with EPLB: only {len(windows)} window(s) logged; raise --num-prompts or lower --interval")
    kept = [(a, b) for a, b, applied in decisions if not applied]
    print(f"rebalances (every layer): {len(decisions) - len(kept)} applied, {len(kept)} kept (the new placement not "
          f"better by the margin; {sum(b < a for a, b in kept)} of them scored worse than the current one)")


if __name__ == "__main__":
    main()
