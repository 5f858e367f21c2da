"""A SmolLM2-135M-shaped model with 8 attention heads and 2 KV heads, random weights.

The default model's 9 heads allow TP 1, 3 or 9 only; this one has the same hidden size,
layers, MLP and vocabulary (so the same FLOPs and bytes per token) and splits over TP=2.
Made once into the stagemesh cache, with the default model's tokenizer beside it.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import torch

from stagemesh.core.default_model import cache_root, default_model_dir


def eight_head_model_dir() -> Path:
    target = cache_root() / "bench" / "smollm2-135m-shape-8-heads"
    if (target / "model.safetensors").is_file():
        return target
    from transformers import AutoConfig, AutoModelForCausalLM

    source = default_model_dir()
    config = AutoConfig.from_pretrained(source)
    config.num_attention_heads, config.num_key_value_heads = 8, 2
    config.head_dim = config.hidden_size // 8  # 72
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.02)
    tmp = target.with_name(target.name + ".tmp")
    model.save_pretrained(tmp, safe_serialization=True)
    for f in source.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges", "generation_config")):
            shutil.copy(f, tmp / f.name)
    tmp.rename(target)
    return target


if __name__ == "__main__":
    print(eight_head_model_dir())
