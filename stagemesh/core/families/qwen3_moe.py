"""Qwen3-MoE: Qwen3's q/k norm, experts renormalised per norm_topk_prob (the Python layer runs its dense
layers)."""
from stagemesh.core.families.family import Experts, Family

FAMILY = Family("qwen3_moe", ("Qwen3MoeForCausalLM",), bias_key="attention_bias", o_proj_bias=True, qk_norm=True,
                sliding_window_switch="use_sliding_window", experts=Experts(), fused_cpu_plan=False)
