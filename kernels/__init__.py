"""Kernels: Triton on CUDA, torch references on CPU, behind one dispatch."""
from kernels.dispatch import (  # noqa: F401
    add_lora,
    apply_rotary,
    build_cos_sin_cache,
    fused_moe,
    merge_attention_states,
    paged_attention,
    paged_attention_lse,
    paged_attention_rows_lse,
    quant_linear,
    rms_norm,
    rotary_and_cache,
    select_experts,
    silu_and_mul,
    write_kv_cache,
)
