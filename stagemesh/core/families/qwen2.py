"""Qwen2 / Qwen2.5: biases on q, k and v, always (transformers reads no switch for them)."""
from stagemesh.core.families.family import GGUF, Family

FAMILY = Family("qwen2", ("Qwen2ForCausalLM",), bias_default=True, sliding_window_switch="use_sliding_window",
                gguf=GGUF("qwen2"))
