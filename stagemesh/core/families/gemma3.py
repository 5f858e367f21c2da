"""Gemma 3, text (Gemma3ForCausalLM): RMSNorm scaling by (1 + weight), a GELU-tanh MLP, sandwich norms (each of
attention and the MLP normed before and after), q/k RMSNorm, embeddings scaled by sqrt(hidden), attention scaled
by query_pre_attn_scalar**-0.5, sliding-window local layers beside global ones (layer_types, or the older
sliding_window_pattern) rotating with their own base (rope_local_base_freq; the global ones' may be linearly
scaled), final logit softcapping and attention-score softcapping where the config sets them. Its layers are
stage_worker.gemma3's; the window runs in the attention (kernels.masked_attention), so the context is the
config's whole max_position_embeddings.

Refused by name: another activation, bidirectional attention (the embedding models), layer types other than
sliding_attention and full_attention. Gemma3ForConditionalGeneration (with its vision tower) is refused by
stagemesh.core.model_config; its text-only checkpoints (Gemma3ForCausalLM) are served."""
from typing import Any

from stagemesh.core.families.family import Family

LAYER_TYPES = ("sliding_attention", "full_attention")


def layer_types(raw: dict[str, Any]) -> list[str]:
    """Each layer's kind, as transformers reads the config (every sliding_window_pattern-th layer global)."""
    given = raw.get("layer_types")
    if given:
        return list(given)
    pattern = int(raw.get("sliding_window_pattern", 6))
    layers = int(raw.get("num_hidden_layers") or 0)
    return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]


def _refuse(raw: dict[str, Any]) -> str | None:
    act = raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        return f"hidden_activation {act!r} (its MLP is GELU-tanh)"
    if raw.get("use_bidirectional_attention"):
        return "use_bidirectional_attention (the bidirectional embedding variant)"
    other = sorted(set(layer_types(raw)) - set(LAYER_TYPES))
    if other:
        return f"layer_types {other} (sliding_attention and full_attention are)"
    if len(layer_types(raw)) != raw.get("num_hidden_layers"):
        return f"layer_types of {len(layer_types(raw))} layers for num_hidden_layers {raw.get('num_hidden_layers')}"
    return None


FAMILY = Family("gemma3_text", ("Gemma3ForCausalLM",), bias_key="attention_bias", o_proj_bias=True, qk_norm=True,
                fused_cpu_plan=False, layer_types=layer_types, stage_model="stage_worker.gemma3", refuse=_refuse,
                layer_norms=("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                             "post_feedforward_layernorm"))
