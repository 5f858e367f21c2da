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
        "CPU with no bf16 instructions (avx2; neither avx512_bf16 nor AMX): float32 path (--dtype bfloat16 reads "
        "half the weight bytes and is faster)")
    assert describe_cpu_path("bfloat16", cpu_flags(AVX2)).endswith(
        "bf16 path, bf16 weights and KV cache, fp32 arithmetic (AVX2 FMA)")
    assert "amx not used yet" in describe_cpu_path("bfloat16", cpu_flags(AMX))
    assert "slower than --dtype float32: the CPU kernels are not built" in describe_cpu_path(
        "bfloat16", cpu_flags(AVX512_BF16), kernels=False)


def test_dtype_auto_on_cpu_is_the_checkpoints_with_fp16_as_bf16():
    import torch

    from kernels import cpu_ops
    from stage_worker.runner import resolve_dtype
    from stagemesh.core.model_config import ModelConfig

    def auto(checkpoint_dtype):
        cfg = ModelConfig.__new__(ModelConfig)
        object.__setattr__(cfg, "torch_dtype", checkpoint_dtype)
        return resolve_dtype(cfg, "auto", "cpu")

    narrow = torch.bfloat16 if cpu_ops.load() is not None else torch.float32
    assert auto("float32") == torch.float32  # never narrowed unasked
    assert auto("bfloat16") == narrow and auto("float16") == narrow


def test_the_kernel_family_is_chosen_by_flags_and_unbuilt_ones_are_named():
    from kernels import isa

    assert isa.chosen(cpu_flags("flags : avx avx2 fma f16c bmi2")).name == "avx2"
    assert isa.march(cpu_flags("flags : avx avx2 fma f16c bmi2")) == "avx2"
    assert isa.chosen(cpu_flags("flags : sse2 avx")).name == "scalar"
    server = cpu_flags("flags : avx2 fma f16c bmi2 avx512f avx512bw avx512vl avx512dq avx512cd avx512_vnni "
                       "avx512_bf16 amx_tile amx_bf16 amx_int8")
    assert isa.chosen(server).name == "avx2" and isa.march(server) == "avx512"
    assert isa.describe(server).endswith("this CPU also has amx, avx512_bf16, avx512_vnni, avx512, whose kernels are "
                                         "not built yet (the avx2 ones run)")
    assert isa.describe(cpu_flags("flags : avx2 fma f16c bmi2"), built=False).endswith(
        "; the C++ kernels are not built")
