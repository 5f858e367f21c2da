"""gpt-oss (GptOssForCausalLM), as published (MXFP4 experts) or in its bf16 dequantized form: attention with
biases (o_proj's too) and a learned sink logit per head, sliding-window (layer_types sliding_attention, 128 tokens)
and full layers alternating, YaRN rope, and a mixture of experts whose router (with a bias) keeps the top k logits
and softmaxes them, each expert a clamped SwiGLU (alpha 1.702, limit 7.0, up + 1) with biases, gate and up
interleaved in one stacked tensor. Its layers are stage_worker.gpt_oss's; the window runs in the attention
(kernels.masked_attention).

The published checkpoint's MXFP4 experts (quantization_config mxfp4) stay packed and are computed from the packed
weights (stage_worker.quant_methods.mxfp4). Refused by name: other quantization_configs, layer types other than
sliding and full attention."""
from typing import Any

from stagemesh.core.families.family import Experts, Family

LAYER_TYPES = ("sliding_attention", "full_attention")


def layer_types(raw: dict[str, Any]) -> list[str]:
    """Each layer's kind, as transformers reads the config (sliding and full alternating unless it says)."""
    layers = int(raw.get("num_hidden_layers") or 0)
    return list(raw.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention"
                                           for i in range(layers)])


def _refuse(raw: dict[str, Any]) -> str | None:
    quant = raw.get("quantization_config")
    if quant:
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else quant
        if method != "mxfp4":  # (its fields: stage_worker.quant_methods.mxfp4)
            return (f"quantization_config {method!r} (gpt-oss is served from its published MXFP4 checkpoint or its "
                    "bf16 dequantized one)")
    kinds = layer_types(raw)
    other = sorted(set(kinds) - set(LAYER_TYPES))
    if other or len(kinds) != raw.get("num_hidden_layers"):
        return f"layer_types {other or kinds} (sliding_attention and full_attention, one per layer, are)"
    return None


def _layer_shapes(cfg, index: int) -> dict[str, tuple[int, ...]]:
    h, q, kv = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    attn, mlp, e, inter = f"model.layers.{index}.self_attn", f"model.layers.{index}.mlp", cfg.num_experts, \
        cfg.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {f"model.layers.{index}.{n}.weight": (h,)
                                          for n in ("input_layernorm", "post_attention_layernorm")}
    for name, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
        shapes.update({f"{attn}.{name}.weight": (rows, h), f"{attn}.{name}.bias": (rows,)})
    shapes.update({f"{attn}.o_proj.weight": (h, q), f"{attn}.o_proj.bias": (h,),
                   f"{attn}.sinks": (cfg.num_attention_heads,),
                   f"{mlp}.router.weight": (e, h), f"{mlp}.router.bias": (e,),
                   f"{mlp}.experts.gate_up_proj": (e, h, 2 * inter), f"{mlp}.experts.gate_up_proj_bias": (e, 2 * inter),
                   f"{mlp}.experts.down_proj": (e, inter, h), f"{mlp}.experts.down_proj_bias": (e, h)})
    return shapes


# experts: a mixture of experts to every service (its count, the planner's shapes); its layer is its own
FAMILY = Family("gpt_oss", ("GptOssForCausalLM",), bias_key="attention_bias", bias_default=True,
                experts=Experts(block="mlp"), fused_cpu_plan=False, layer_types=layer_types,
                own_quant_methods=("mxfp4",), stage_model="stage_worker.gpt_oss", layer_shapes_of=_layer_shapes,
                refuse=_refuse)
