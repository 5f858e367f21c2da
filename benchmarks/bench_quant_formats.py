"""Each quantised checkpoint format against bf16 on CPU, the default model written in each format as its
quantizer writes it (tests/quant_checkpoints.py): batch-1 decode TPOT and the process's resident memory while it
serves (VmRSS after load and a warm-up, the engine still up; beside it the peak, which loading sets), each arm in its
own process, the arms alternating each round.

    .venv/bin/python benchmarks/bench_quant_formats.py [--rounds 2] [--tokens 32] [--threads 2] [--formats ...]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

FORMATS = ("bf16", "fp32", "ct-fp8-channel", "fbgemm-fp8", "fp8-block", "ct-int8", "ct-w4a16", "gptq-int4", "awq",
           "gguf-q4_1")


def one(path: str, fmt: str, tokens: int, threads: int) -> dict:
    """In this process: the arm's TPOT (ms) and RSS (MiB, peak)."""
    import torch

    from benchmarks.bench_bf16_cpu import tpot_ms
    from stagemesh.core.default_model import gguf_path
    from stagemesh.entry.local_engine import LocalEngine

    torch.set_num_threads(threads)
    # every arm in bf16 (the quantised ones: bf16 activations, tables and norms), with a small KV cache, so that
    # the RSS is the weights' and the runtime's
    kw: dict = dict(dtype="float32" if fmt == "fp32" else "bfloat16", kv_cache_memory=64 * 2**20)
    if fmt.startswith("gguf"):
        kw.update(quantization="gguf", gguf_file=str(gguf_path()))
    with LocalEngine.of(path, **kw) as engine:
        prompt = list(range(100, 164))
        tpot_ms(engine, prompt, 8)  # warm-up
        tpot = statistics.median(tpot_ms(engine, prompt, tokens) for _ in range(3))
        weights = sum(r.model.num_parameter_bytes() for r in engine.runners) / 2**20
        rss = resident_mib()  # while the engine holds its model
    return {"tpot_ms": tpot, "rss_mib": rss, "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "weights_mib": weights}


def resident_mib() -> float:
    """This process's resident memory now (VmRSS), in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--formats", default=",".join(FORMATS))
    p.add_argument("--one", nargs=2, metavar=("DIR", "FORMAT"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        print(json.dumps(one(args.one[0], args.one[1], args.tokens, args.threads)))
        return
    from quant_checkpoints import write_quantized
    from stagemesh.core.default_model import default_model_dir
    from stage_worker.cpu_isa import cpu_flags, describe_isa

    base = default_model_dir()
    print(describe_isa(cpu_flags()))
    formats = args.formats.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        paths = {f: str(base) if f in ("bf16", "fp32") or f.startswith("gguf") else
                 str(write_quantized(base, Path(tmp) / f, f)[0]) for f in formats}
        results = run_arms(paths, args.rounds, args.tokens, args.threads)
    print_table(results)


def run_arms(paths: dict[str, str], rounds: int, tokens: int, threads: int) -> dict[str, list[dict]]:
    """Each arm (format: model directory) in its own process, the arms alternating each round."""
    results: dict[str, list[dict]] = {f: [] for f in paths}
    for _ in range(rounds):
        for f, path in paths.items():
            out = subprocess.run([sys.executable, __file__, "--one", path, f, "--tokens", str(tokens),
                                  "--threads", str(threads)], capture_output=True, text=True, check=True)
            results[f].append(json.loads(out.stdout.strip().splitlines()[-1]))
    return results


def print_table(results: dict[str, list[dict]]) -> None:
    formats = list(results)
    bf16 = statistics.median(r["tpot_ms"] for r in results.get("bf16", [{"tpot_ms": float("nan")}]))
    bf16_rss = statistics.median(r["rss_mib"] for r in results.get("bf16", [{"rss_mib": float("nan")}]))
    print("| format | batch-1 TPOT (ms) | decode tok/s | vs bf16 | weights held (MiB) | RSS serving (MiB) | vs bf16 | "
          "peak RSS, load included (MiB) |")
    print("|---|---|---|---|---|---|---|---|")
    for f in formats:
        tpot = statistics.median(r["tpot_ms"] for r in results[f])
        rss = statistics.median(r["rss_mib"] for r in results[f])
        held = statistics.median(r["weights_mib"] for r in results[f])
        peak = statistics.median(r["peak_mib"] for r in results[f])
        print(f"| {f} | {tpot:.1f} | {1e3 / tpot:.1f} | {bf16 / tpot:.2f}x | {held:.0f} | {rss:.0f} | "
              f"{rss / bf16_rss:.2f}x | {peak:.0f} |")


if __name__ == "__main__":
    main()
