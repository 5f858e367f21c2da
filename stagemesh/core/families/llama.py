"""Llama 2 / 3 (and SmolLM, the embedded default model): the plain family every other one varies."""
from stagemesh.core.families.family import GGUF, Family

FAMILY = Family("llama", ("LlamaForCausalLM",), bias_key="attention_bias", o_proj_bias=True,
                gguf=GGUF("llama", permuted_qk=True))
