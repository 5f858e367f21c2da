"""The CPU kernel families by instruction set, from /proc/cpuinfo's flags: which one this CPU gets, and
which the table names that are not built yet (their CPUs run the best built family beneath them).

The C++ kernels are compiled once per machine for the family's -march level (kernels/cpu_ops.py); the SIMD
code in them is AVX2 + FMA (+ F16C). No AVX-512, avx512_bf16, VNNI or AMX kernel is written yet: untested SIMD
code is a liability, and the machines this project is developed on have none of them.
"""
from __future__ import annotations

from pathlib import Path
from typing import NamedTuple


class Family(NamedTuple):
    name: str
    flags: frozenset[str]  # every one of them must be in /proc/cpuinfo
    built: bool
    adds: str  # what its kernels would use


# Best first. A CPU gets the first built family whose flags it has; the unbuilt ones above it are named in
# the stage's start-up line as what such a CPU would run once they exist.
FAMILIES = (
    Family("amx", frozenset({"amx_tile", "amx_bf16", "amx_int8"}), False, "AMX tiles for bf16 and int8 products"),
    Family("avx512_bf16", frozenset({"avx512f", "avx512bw", "avx512vl", "avx512_bf16"}), False,
           "vdpbf16ps bf16 dot products"),
    Family("avx512_vnni", frozenset({"avx512f", "avx512bw", "avx512vl", "avx512_vnni"}), False,
           "vpdpbusd int8 dot products (w8a8, q8 activations)"),
    Family("avx512", frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"}), False,
           "16-wide FMA"),
    Family("avx2", frozenset({"avx2", "fma", "f16c", "bmi2"}), True, "8-wide FMA, vpmaddubsw/vpmaddwd int8"),
    Family("scalar", frozenset(), True, "the torch reference (no C++ SIMD kernels)"),
)


def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    """The feature flags of the first CPU in /proc/cpuinfo (empty where there is none)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def present(flags: set[str]) -> list[Family]:
    return [f for f in FAMILIES if f.flags <= flags]


def chosen(flags: set[str]) -> Family:
    """The family whose kernels run on a CPU with these flags."""
    return next(f for f in present(flags) if f.built)


def march(flags: set[str]) -> str:
    """The -march level the kernels are compiled for: x86-64-v4 where the AVX-512 base is, x86-64-v3 for AVX2."""
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"} <= flags:
        return "avx512"
    return "avx2" if chosen(flags).name == "avx2" else "generic"


def describe(flags: set[str], built: bool = True) -> str:
    """One line: the family that runs and the unbuilt families this CPU has (built: the C++ kernels are)."""
    run = chosen(flags) if built else FAMILIES[-1]
    waiting = [f for f in present(flags) if not f.built]
    line = f"CPU kernels: {run.name} ({run.adds})"
    if not built and chosen(flags).name != "scalar":
        line += "; the C++ kernels are not built"
    if waiting:
        line += ("; this CPU also has " + ", ".join(f.name for f in waiting) +
                 ", whose kernels are not built yet (the avx2 ones run)")
    return line
