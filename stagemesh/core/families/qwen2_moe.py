"""Qwen2-MoE: QKV biases (its config's qkv_bias), experts plus a shared expert behind a sigmoid gate."""
from stagemesh.core.families.family import Experts, Family

FAMILY = Family("qwen2_moe", ("Qwen2MoeForCausalLM",), bias_key="qkv_bias", bias_default=True,
                sliding_window_switch="use_sliding_window", experts=Experts())
