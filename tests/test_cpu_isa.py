"""The start-up log line that says which CPU path a stage runs, from the CPU's flags."""
from __future__ import annotations

import pytest

from stage_worker.cpu_isa import bf16_isa, cpu_flags, describe_cpu_path

AVX2 = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma\n"
AVX512_BF16 = "flags\t\t: avx2 fma f16c bmi2 avx512f avx512bw avx512vl avx512_bf16 avx512_vnni\n"
AMX = "flags\t\t: avx2 fma f16c bmi2 avx512f avx512bw avx512vl avx512_bf16 amx_bf16 amx_tile amx_int8\n"


def test_bf16_instructions_are_found_in_the_flags():
    assert bf16_isa(cpu_flags(AVX2)) is None
    assert bf16_isa(cpu_flags(AVX512_BF16)) == "avx512_bf16"
    assert bf16_isa(cpu_flags(AMX)) == "amx"
    assert cpu_flags("no flags line") == set()


def test_the_log_line_says_which_path_runs_and_why():
    assert describe_cpu_path("float32", cpu_flags(AVX2)) == (
        "CPU with no bf16 instructions (avx2; neither avx512_bf16 nor AMX): float32 path (--dtype bfloat16 reads "
        "half the weight bytes and is faster)")
    assert describe_cpu_path("bfloat16", cpu_flags(AVX2)).endswith(
        "bf16 path, bf16 weights and KV cache, fp32 sums (AVX2 FMA)")
    assert describe_cpu_path("bfloat16", cpu_flags(AMX)).endswith("(avx512_bf16 dot products; amx not used yet)")
    assert describe_cpu_path("bfloat16", cpu_flags(AVX512_BF16)).endswith(
        "bf16 weights and KV cache, fp32 sums (avx512_bf16 dot products)")
    assert "slower than --dtype float32: the CPU kernels are not built" in describe_cpu_path(
        "bfloat16", cpu_flags(AVX512_BF16), kernels=False)


def test_dtype_auto_on_cpu_is_the_checkpoints_with_fp16_as_bf16():
    import torch

    from kernels import cpu_ops
    from stage_worker.loading import resolve_dtype
    from stagemesh.core.model_config import ModelConfig

    def auto(checkpoint_dtype):
        cfg = ModelConfig.__new__(ModelConfig)
        object.__setattr__(cfg, "torch_dtype", checkpoint_dtype)
        return resolve_dtype(cfg, "auto", "cpu")

    narrow = torch.bfloat16 if cpu_ops.load() is not None else torch.float32
    assert auto("float32") == torch.float32  # never narrowed unasked
    assert auto("bfloat16") == narrow and auto("float16") == narrow


def test_the_kernel_family_is_chosen_by_flags_and_unbuilt_ones_are_named(monkeypatch):
    from kernels import isa

    monkeypatch.delenv("STAGEMESH_CPU_ISA", raising=False)
    avx2 = cpu_flags("flags : avx avx2 fma f16c bmi2")
    assert isa.chosen(avx2).name == "avx2" and isa.march(avx2) == "avx2"
    assert isa.family_for("bf16", avx2) == "avx2" and isa.family_for("quant", avx2) == "avx2"
    assert isa.chosen(cpu_flags("flags : sse2 avx")).name == "scalar"
    assert isa.march(cpu_flags("flags : sse2 avx")) == "generic"
    server = cpu_flags("flags : avx2 fma f16c bmi2 avx512f avx512bw avx512vl avx512dq avx512cd avx512_vnni "
                       "avx512_bf16 amx_tile amx_bf16 amx_int8")
    assert isa.chosen(server).name == "avx512_bf16" and isa.march(server) == "avx512"
    assert isa.family_for("bf16", server) == "avx512_bf16" and isa.family_for("quant", server) == "avx512_bf16"
    assert isa.family_for("bf16", server, built=False) == "avx2"  # the build cannot emit them
    assert isa.family_for("attention", server) == "avx512" and isa.family_for("attention", avx2) == "avx2"
    assert isa.describe(server) == (
        "CPU kernels: avx512_bf16 (vdpbf16ps bf16 dot products for bf16 weights), avx512_vnni (vpdpbusd int8 dot "
        "products for w8a8), avx512 (16-wide FMA decode attention and quantised products), avx2 (8-wide FMA, "
        "vpmaddubsw/vpmaddwd int8) for the rest; this CPU also has amx, whose kernels are not built yet")
    cascade_lake = cpu_flags("flags : avx2 fma f16c bmi2 avx512f avx512bw avx512vl avx512dq avx512cd avx512_vnni")
    assert isa.family_for("bf16", cascade_lake) == "avx2" and isa.family_for("quant", cascade_lake) == "avx512_vnni"
    assert isa.family_for("attention", cascade_lake) == "avx512"
    skylake_x = cpu_flags("flags : avx2 fma f16c bmi2 avx512f avx512bw avx512vl avx512dq avx512cd")
    assert isa.family_for("quant", skylake_x) == "avx512"  # AVX-512 without VNNI: the fp32 products' tile
    assert isa.describe(avx2, built=False).endswith("; the C++ kernels are not built")
    # STAGEMESH_CPU_ISA caps the choice, to compare the families on one machine
    monkeypatch.setenv("STAGEMESH_CPU_ISA", "avx2")
    assert isa.family_for("bf16", server) == "avx2" and isa.family_for("quant", server) == "avx2"
    assert isa.family_for("attention", server) == "avx2"
    assert isa.describe(server).startswith("CPU kernels: avx2 (")
    monkeypatch.setenv("STAGEMESH_CPU_ISA", "avx9")
    with pytest.raises(ValueError, match="STAGEMESH_CPU_ISA='avx9' is not a kernel family"):
        isa.family_for("bf16", server)
