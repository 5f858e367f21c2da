"""The CPU kernel families by instruction set, from /proc/cpuinfo's flags: which ones this CPU runs, and
which the table names that are not built yet.

The C++ kernels are compiled once per machine for the CPU's -march level (kernels/cpu_ops.py). The avx2
family (AVX2 + FMA + F16C) has every kernel. Three kernels have a second family, compiled with its target
for those functions alone and chosen at load where the CPU has the instructions:
- bf16 linear (kernels/csrc/bf16_linear_avx512bf16.cpp): avx512_bf16, vdpbf16ps on bf16 pairs;
- quantised products (kernels/csrc/quant_linear.cpp): avx512, the fp32 products of few rows 16 lanes wide;
  avx512_vnni, those and the int8 products of w8a8 on vpdpbusd; avx512_bf16, avx512_vnni's and the fp32
  products of many rows (prefill, batches) on vdpbf16ps, x split into two bf16 (hi + lo, x to 2^-18);
- decode attention (kernels/csrc/decode_attention_avx512.cpp): avx512, 16-wide FMA in 32 registers.
AMX tiles are not written (this project's machines have no AMX to test them on); the fp32 products run
on oneDNN, which uses AVX-512 where the CPU has it.
STAGEMESH_CPU_ISA=<family> caps the choice at that family (avx2: the avx2 kernels everywhere), to compare
the families on one machine.
"""
from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import NamedTuple


class Family(NamedTuple):
    name: str
    flags: frozenset[str]  # every one of them must be in /proc/cpuinfo
    built: bool
    adds: str  # what its kernels use


# Best first.
FAMILIES = (
    Family("amx", frozenset({"amx_tile", "amx_bf16", "amx_int8"}), False, "AMX tiles for bf16 and int8 products"),
    Family("avx512_bf16", frozenset({"avx512f", "avx512bw", "avx512vl", "avx512_bf16"}), True,
           "vdpbf16ps bf16 dot products for bf16 weights"),
    Family("avx512_vnni", frozenset({"avx512f", "avx512bw", "avx512vl", "avx512_vnni"}), True,
           "vpdpbusd int8 dot products for w8a8"),
    Family("avx512", frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"}), True,
           "16-wide FMA decode attention and quantised products"),
    Family("avx2", frozenset({"avx2", "fma", "f16c", "bmi2"}), True, "8-wide FMA, vpmaddubsw/vpmaddwd int8"),
    Family("scalar", frozenset(), True, "the torch reference (no C++ SIMD kernels)"),
)
BY_NAME = {f.name: f for f in FAMILIES}

# The families each kernel has, best first (avx2 has them all).
KERNELS = {"bf16": ("avx512_bf16", "avx2"), "quant": ("avx512_bf16", "avx512_vnni", "avx512", "avx2"),
           "attention": ("avx512", "avx2")}


def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    """The feature flags of the first CPU in cpuinfo's text; by default this machine's /proc/cpuinfo (read
    once: every packed weight asks), empty where there is none."""
    if cpuinfo is None:
        return set(_this_cpu())
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


@functools.cache
def _this_cpu() -> frozenset[str]:
    try:
        return frozenset(cpu_flags(Path("/proc/cpuinfo").read_text()))
    except OSError:
        return frozenset()


def _allowed(name: str) -> bool:
    """Not above STAGEMESH_CPU_ISA's family in FAMILIES' order (unset: every family)."""
    cap = os.environ.get("STAGEMESH_CPU_ISA", "").strip()
    if not cap:
        return True
    if cap not in BY_NAME:
        raise ValueError(f"STAGEMESH_CPU_ISA={cap!r} is not a kernel family ({', '.join(BY_NAME)})")
    order = [f.name for f in FAMILIES]
    return order.index(name) >= order.index(cap)


def present(flags: set[str]) -> list[Family]:
    return [f for f in FAMILIES if f.flags <= flags]


def running(flags: set[str]) -> list[Family]:
    """The built families whose kernels run on a CPU with these flags (not the scalar one where avx2 runs)."""
    runs = [f for f in present(flags) if f.built and _allowed(f.name)]
    return [f for f in runs if f.name != "scalar"] or [FAMILIES[-1]]


def chosen(flags: set[str]) -> Family:
    """The best family that runs on a CPU with these flags."""
    return running(flags)[0]


def family_for(kernel: str, flags: set[str], built: bool = True) -> str:
    """Which family's `kernel` ("bf16", "quant", "attention") runs: the best one the CPU has (built: the build has it
    too, as the module says), else avx2."""
    names = {f.name for f in running(flags)}
    return next((n for n in KERNELS[kernel] if n in names and (built or n == "avx2")), "avx2")


def march(flags: set[str]) -> str:
    """The -march level the kernels are compiled for: x86-64-v4 where the AVX-512 base is, x86-64-v3 for AVX2."""
    if BY_NAME["avx512"].flags <= flags:
        return "avx512"
    return "avx2" if BY_NAME["avx2"].flags <= flags else "generic"


def describe(flags: set[str], built: bool = True) -> str:
    """One line: the families that run and the unbuilt ones this CPU has (built: the C++ kernels are)."""
    runs = running(flags) if built else [FAMILIES[-1]]
    line = "CPU kernels: " + ", ".join(f"{f.name} ({f.adds})" for f in runs)
    if len(runs) > 1:
        line += " for the rest"
    if not built and running(flags)[0].name != "scalar":
        line += "; the C++ kernels are not built"
    waiting = [f for f in present(flags) if not f.built]
    if waiting:
        line += "; this CPU also has " + ", ".join(f.name for f in waiting) + ", whose kernels are not built yet"
    return line
