"""The quantised linear on a GPU (kernels/triton_quant.py, weight-only) against bf16's cuBLAS product, on the
linear shapes of Llama-3.1-8B (merged qkv, o, merged gate/up, down), bf16 activations:

    python benchmarks/bench_quant_gpu.py [--rows 1 16 64 256] [--sweep]

For each layout (int8 and fp8 with a scale per row: --quantization w8a16 / fp8; GGUF's Q8_0 and Q4_1 as
groups of 32) it prints the time of one product, the weight bytes it reads per second as a fraction of the
GPU's copy bandwidth, and its speed-up over bf16. --sweep times the fused kernel's other tiles at 16, 64 and
256 rows beside the path quant_linear takes (kernels.triton_quant.tile_config, DEQUANTISE_ABOVE), to check
the choice on this GPU.
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
import triton
import triton.testing

from kernels import quant_reference as qref
from kernels.triton_quant import DEQUANTISE_ABOVE, TileConfig, quant_linear, tile_config

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def copy_bandwidth() -> float:
    src = torch.empty(2 * 2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=10, rep=100)
    return 2 * src.numel() / (ms / 1e3)


def layouts(w: torch.Tensor) -> dict:
    """(qs, scales, mins) of w in each layout, on the GPU."""
    n, k = w.shape
    i8, s8 = qref.quantize_int8_per_channel(w)
    f8, sf = qref.quantize_fp8_per_channel(w)
    g = w.float().view(n, k // 32, 32)
    d = g.abs().amax(-1) / 127
    q8 = torch.round(g / d.clamp_min(1e-12)[..., None]).clamp(-127, 127).to(torch.int8).view(n, k)
    lo, hi = g.amin(-1), g.amax(-1)
    d4 = (hi - lo) / 15
    q4 = torch.round((g - lo[..., None]) / d4.clamp_min(1e-12)[..., None]).clamp(0, 15).to(torch.uint8).view(n, k)
    return {"int8 (row)": (i8, s8, None), "fp8 (row)": (f8, sf, None), "Q8_0 (g32)": (q8, d.contiguous(), None),
            "Q4_1 (g32)": (qref.pack_4bit(q4), d4.contiguous(), lo.contiguous())}


def nbytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


DECODE_TILES = [TileConfig(16, bn, bk, 4, st) for bn in (32, 64) for bk in (256, 512) for st in (4, 5)]
MID_TILES = [TileConfig(*c) for c in ((16, 64, 256, 4, 5), (32, 64, 128, 4, 4), (32, 64, 256, 4, 4),
                                      (64, 64, 128, 4, 4), (32, 128, 128, 4, 4), (64, 128, 64, 4, 4),
                                      (64, 128, 128, 8, 3), (128, 128, 64, 8, 3))]


def sweep(name: str, rows: int, x: torch.Tensor, qs, scales, mins, tiles) -> None:
    """Times the fused kernel on each tile beside the path quant_linear takes for these rows."""
    n, k = qs.shape[0], x.shape[1]
    group = k // scales.shape[1]
    chosen = triton.testing.do_bench(lambda: quant_linear(x, qs, scales, mins), warmup=5, rep=25)
    times = {}
    for c in tiles:
        if k % c.block_k or (c.block_k % group and group % c.block_k):
            continue
        try:
            times[c] = triton.testing.do_bench(lambda: quant_linear(x, qs, scales, mins, config=c), warmup=5, rep=25)
        except Exception as e:  # a tile this GPU cannot hold (shared memory): say so, go on
            print(f"    {tuple(c)}: {type(e).__name__}")
    path = "dequantise + cuBLAS" if rows > DEQUANTISE_ABOVE else \
        tuple(tile_config(rows, n, k, group, four_bit=qs.dtype == torch.uint8))
    print(f"    sweep {name} [{n}, {k}], {rows} rows: taken {path} {chosen * 1e3:.1f} us; fused tiles: "
          + ", ".join(f"{tuple(c)} {t * 1e3:.1f}" for c, t in sorted(times.items(), key=lambda ct: ct[1])[:4]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 256])
    p.add_argument("--sweep", action="store_true")
    a = p.parse_args()
    bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bw / 1e12:.2f} TB/s (read + write)")
    g = torch.Generator(device="cuda").manual_seed(0)
    for shape, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02
        quantised = layouts(w)
        for rows in a.rows:
            x = torch.randn(rows, k, device="cuda", generator=g, dtype=torch.bfloat16)
            base = triton.testing.do_bench(lambda: F.linear(x, w), warmup=10, rep=50)
            print(f"{shape} [{n}, {k}] x {rows} rows: bf16 cuBLAS {base * 1e3:.1f} us "
                  f"({nbytes(w) / (base / 1e3) / bw:.2f} of copy bandwidth)")
            for name, (qs, scales, mins) in quantised.items():
                want = qref.quant_linear(x[:2].float(), qs, scales, mins)
                got = quant_linear(x[:2], qs, scales, mins).float()
                err = ((got - want).abs().max() / want.abs().max()).item()
                ms = triton.testing.do_bench(lambda: quant_linear(x, qs, scales, mins), warmup=10, rep=50)
                print(f"    {name:11s} {ms * 1e3:8.1f} us  {nbytes(qs, scales, mins) / (ms / 1e3) / bw:5.2f} of copy "
                      f"bandwidth  {base / ms:5.2f}x bf16  (max error {err:.1e} of max|y|)")
        if a.sweep:
            for rows, tiles in ((16, DECODE_TILES), (64, MID_TILES), (256, MID_TILES)):
                x = torch.randn(rows, k, device="cuda", generator=g, dtype=torch.bfloat16)
                for name in ("int8 (row)", "Q4_1 (g32)"):
                    sweep(name, rows, x, *quantised[name], tiles)


if __name__ == "__main__":
    main()
