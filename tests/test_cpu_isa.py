"""The start-up log line that says which CPU path a stage runs, from the CPU's flags."""
from __future__ import annotations

from stage_worker.cpu_isa import bf16_isa, cpu_flags, describe_cpu_path

AVX2 = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma\n"
AVX512_BF16 = "flags\t\t: avx2 avx512f avx512_bf16 avx512_vnni\n"
AMX = "flags\t\t: avx2 avx512f avx512_bf16 amx_bf16 amx_tile amx_int8\n"


def test_bf16_instructions_are_found_in_the_flags():
    assert bf16_isa(cpu_flags(AVX2)) is None
    assert bf16_isa(cpu_flags(AVX512_BF16)) == "avx512_bf16"
    assert bf16_isa(cpu_flags(AMX)) == "amx"
    assert cpu_flags("no flags line") == set()


def test_the_log_line_says_which_path_runs_and_why():
    assert describe_cpu_path("float32", cpu_flags(AVX2)) == (
        "CPU with no bf16 instructions (avx2; neither avx512_bf16 nor AMX): float32 path (fp32 is the fast path "
        "on this CPU)")
    assert "emulated in fp32 (slower than --dtype float32 here)" in describe_cpu_path("bfloat16", cpu_flags(AVX2))
    assert "oneDNN bf16 products" in describe_cpu_path("bfloat16", cpu_flags(AMX))
    assert "auto stays fp32" in describe_cpu_path("float32", cpu_flags(AVX512_BF16))
