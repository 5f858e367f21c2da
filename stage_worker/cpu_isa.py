"""Which bf16 instructions this CPU has, and which compute path a CPU stage runs, for the start-up log.

vLLM's CPU build runs bf16 by default where the CPU has bf16 instructions (avx512_bf16, or AMX tiles);
stagemesh's `--dtype auto` stays fp32 on every CPU for now: its bf16 path is torch's generic one, which
was measured slower than its packed fp32 path even on a CPU with avx512_bf16 (issue 22's figures: 103 vs
117 tok/s), so picking it would make `auto` slower. The log says which path runs and why.
"""
from __future__ import annotations

from pathlib import Path


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


def bf16_isa(flags: set[str]) -> str | None:
    """"amx" (AMX bf16 tiles), "avx512_bf16", or None."""
    if {"amx_bf16", "amx_tile"} <= flags:
        return "amx"
    if "avx512_bf16" in flags:
        return "avx512_bf16"
    return None


def describe_cpu_path(dtype: str, flags: set[str]) -> str:
    """One log line: the ISA and the path this stage's dtype runs on it."""
    isa = bf16_isa(flags)
    vector = "avx512" if "avx512f" in flags else "avx2" if "avx2" in flags else "no avx2"
    has = f"{isa} bf16 instructions" if isa else f"no bf16 instructions ({vector}; neither avx512_bf16 nor AMX)"
    if dtype == "bfloat16":
        how = "oneDNN bf16 products" if isa else "bf16 products emulated in fp32 (slower than --dtype float32 here)"
        return f"CPU with {has}: bf16 path, {how}"
    if dtype != "float32":
        return f"CPU with {has}: {dtype} path"
    why = ("--dtype auto stays fp32: stagemesh's bf16 CPU path is not yet faster than its packed fp32 one"
           if isa else "fp32 is the fast path on this CPU")
    return f"CPU with {has}: float32 path ({why})"
