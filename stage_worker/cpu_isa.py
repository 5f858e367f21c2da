"""Which bf16 instructions this CPU has, and which compute path a CPU stage runs, for the start-up log.

stagemesh's bf16 CPU path stores weights, activations and the KV cache in bf16 and sums in fp32
(kernels/csrc/bf16_linear*.cpp and the fused kernels): it reads half the bytes of the fp32 path. Its
linear products run on vdpbf16ps where the CPU has avx512_bf16 and on AVX2 FMA (bf16 widened to fp32)
elsewhere, so it is faster than fp32 on any x86 CPU with AVX2 (benchmarks/bench_bf16_cpu.py). AMX tiles
are not used yet; where a CPU has them the log says so. `--dtype auto` on CPU follows vLLM: the
checkpoint's dtype, with fp16 as bf16; bf16 needs the built kernels (torch's own bf16 ops are slower
than fp32 on a CPU without bf16 instructions), else fp32.
"""
from __future__ import annotations

from kernels.isa import cpu_flags, describe as describe_isa, family_for  # noqa: F401 - the kernel families


def bf16_isa(flags: set[str]) -> str | None:
    """"amx" (AMX bf16 tiles), "avx512_bf16", or None."""
    if {"amx_bf16", "amx_tile"} <= flags:
        return "amx"
    if "avx512_bf16" in flags:
        return "avx512_bf16"
    return None


def describe_cpu_path(dtype: str, flags: set[str], kernels: bool = True) -> str:
    """One log line: the ISA and the path this stage's dtype runs on it (kernels: the C++ CPU kernels are built)."""
    isa = bf16_isa(flags)
    vector = "avx512" if "avx512f" in flags else "avx2" if "avx2" in flags else "no avx2"
    has = f"{isa} bf16 instructions" if isa else f"no bf16 instructions ({vector}; neither avx512_bf16 nor AMX)"
    if dtype == "bfloat16":
        if not kernels:
            how = "torch's bf16 ops (slower than --dtype float32: the CPU kernels are not built)"
        else:
            dots = "avx512_bf16 dot products" if family_for("bf16", flags) == "avx512_bf16" else "AVX2 FMA"
            how = f"bf16 weights and KV cache, fp32 sums ({dots}" + ("; amx not used yet)" if isa == "amx" else ")")
        return f"CPU with {has}: bf16 path, {how}"
    if dtype != "float32":
        return f"CPU with {has}: {dtype} path"
    why = "--dtype bfloat16 reads half the weight bytes and is faster" if kernels else "the CPU kernels are not built"
    return f"CPU with {has}: float32 path ({why})"
