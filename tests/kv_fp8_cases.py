"""Helpers of the fp8 KV cache's tests: checkpoints with KV scale tensors written as quantizers write them, and
transformers with its keys and values stored as an fp8 cache stores them (the reference of the model's path)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from kernels import kv_quant


def with_tensors(model_dir: Path, target: Path, tensors: dict[str, torch.Tensor], config: dict | None = None) -> Path:
    """A copy of the model with `tensors` added (a second safetensors file) and `config` merged into its
    config.json."""
    from safetensors.torch import save_file

    shutil.copytree(model_dir, target)
    if tensors:
        save_file(tensors, str(target / "kv_scales.safetensors"))
    if config:
        path = target / "config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    return target


def layer_scales(num_layers: int, k: float = 0.011, v: float = 0.007, names=("k_scale", "v_scale")) -> dict:
    """Per-tensor scales of every layer, a little different per layer, as llm-compressor writes them."""
    out = {}
    for i in range(num_layers):
        out[f"model.layers.{i}.self_attn.{names[0]}"] = torch.tensor(k * (1 + i / 10))
        out[f"model.layers.{i}.self_attn.{names[1]}"] = torch.tensor(v * (1 + i / 7))
    return out


def fp8_reference(model_dir, scales: list[tuple[float, float]], dtype=torch.float8_e4m3fn, forward=None):
    """transformers on the model's weights, each layer's keys (after the rotation) and values read back as an fp8
    cache of these scales holds them: what --kv-cache-dtype fp8 computes. forward: the attention that then runs
    (sdpa; a family's eager one where sdpa lacks what it needs, gpt-oss's sinks)."""
    from transformers import AttentionInterface, AutoModelForCausalLM
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask

    # the mask of the attention that runs (a new name's default mask has no sliding window)
    AttentionMaskInterface.register("stagemesh_fp8_kv", eager_mask if forward else sdpa_mask)
    forward = forward or sdpa_attention_forward

    def attention(module, query, key, value, attention_mask, **kw):
        k_scale, v_scale = scales[module.layer_idx]
        key = kv_quant.dequantize(kv_quant.quantize(key, k_scale, dtype), k_scale, key.dtype)
        value = kv_quant.dequantize(kv_quant.quantize(value, v_scale, dtype), v_scale, value.dtype)
        return forward(module, query, key, value, attention_mask, **kw)

    AttentionInterface.register("stagemesh_fp8_kv", attention)
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                attn_implementation="stagemesh_fp8_kv").eval()
