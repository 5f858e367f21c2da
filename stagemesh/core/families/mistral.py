"""Mistral: Llama's layers; its sliding_window caps the context (stagemesh.core.model_config)."""
from stagemesh.core.families.family import GGUF, Family

FAMILY = Family("mistral", ("MistralForCausalLM",), gguf=GGUF("llama", permuted_qk=True))
