"""The many-row quantised products (prefill chunks, batches) of the default model's shapes, in GFLOPS, against
the alternatives on the same weights: Q4_1-like weights (fp16 scales and mins, groups of 32), M rows of fp32 x,
best of calls for about 0.4 s each, the arms alternating per shape.

Arms: avx2 (the avx2 tiles: the quantised family avx512_vnni, whose many-row products are avx2's), pairs (the
avx512_bf16 family: quants exact in bf16 against x split into two bf16 on vdpbf16ps), singles (the same family
given x in bf16, as a model served in bf16 gives it: the weights dequantised to bf16 a tile at a time, two columns
of K a vdpbf16ps, the product written in bf16), mm (torch.mm of the
weights dequantised to fp32 once, outside the timing: oneDNN / MKL sgemm), bf16 (linear_bf16 avx512_bf16 of the
dequantised weights packed once: x rounded to bf16, not the fp32 model's numbers).

    .venv/bin/python benchmarks/bench_quant_many_rows.py [--rows 32,256,2048] [--arms avx2,pairs,mm,bf16] \
        [--threads 1]   (arms: avx2, pairs, singles, mm, bf16)
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}  # N, K


def best_s(f, budget: float = 0.4) -> float:
    f()
    f()
    best, n, end = float("inf"), 0, time.perf_counter() + budget
    while n < 3 or time.perf_counter() < end:
        start = time.perf_counter()
        f()
        best, n = min(best, time.perf_counter() - start), n + 1
    return best


def main() -> None:
    from kernels import cpu_ops
    from kernels import quant_reference as ref
    from stage_worker.cpu_isa import cpu_flags, describe_isa

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", default="32,256,2048")
    parser.add_argument("--arms", default="avx2,pairs,mm,bf16")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    arms = args.arms.split(",")
    g = torch.Generator().manual_seed(0)
    print(f"many-row quantised products, {args.threads} threads, GFLOPS (best); {describe_isa(cpu_flags())}")
    for name, (n, k) in SHAPES.items():
        scales = (torch.rand(n, k // 32, generator=g) * 0.02).half()
        mins = (-scales.float()).half()
        qs = ref.pack_4bit(torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8))
        w = ref.dequantize(qs, scales.float(), mins.float())
        packed = cpu_ops.pack_bf16_weight(w, "avx512_bf16") if "bf16" in arms else None
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, k, generator=g)
            xb = x.bfloat16()
            calls = {"avx2": lambda: cpu_ops.quant_linear(x, qs, scales, mins, None, False, "avx512_vnni"),
                     "pairs": lambda: cpu_ops.quant_linear(x, qs, scales, mins, None, False, "avx512_bf16"),
                     "singles": lambda: cpu_ops.quant_linear(xb, qs, scales, mins, None, False, "avx512_bf16"),
                     "mm": lambda: torch.mm(x, w.T), "bf16": lambda: cpu_ops.linear_bf16(x, packed, n)}
            flops = 2 * m * n * k / 1e9
            print(f"{name:8s} N={n:5d} K={k:5d} M={m:5d}  "
                  + "  ".join(f"{a} {flops / best_s(calls[a]):6.1f}" for a in arms), flush=True)


if __name__ == "__main__":
    main()
