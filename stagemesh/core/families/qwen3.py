"""Qwen3: RMSNorm on each head of q and k before the rotation (the Python layer runs it)."""
from stagemesh.core.families.family import GGUF, Family

FAMILY = Family("qwen3", ("Qwen3ForCausalLM",), bias_key="attention_bias", o_proj_bias=True, qk_norm=True,
                sliding_window_switch="use_sliding_window", gguf=GGUF("qwen3"), fused_cpu_plan=False)
