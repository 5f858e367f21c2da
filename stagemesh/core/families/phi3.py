"""Phi-3 (Phi3ForCausalLM): Llama's layers with q, k and v in one tensor (qkv_proj) and gate and up in another
(gate_up_proj); its sliding_window caps the context (stagemesh.core.model_config). The merged linears read their
rows out of the fused tensors, so TP shards them as Llama's and the fused CPU layer plan runs it. GGUF files
(llama.cpp's phi3: attn_qkv, and ffn_up holding gate and up) are served too, q and k not permuted.

Refused: LongRoPE / SuRoPE scaling (the 128k variants) and partial rotary, which the rotary kernels do not do."""
from typing import Any

from stagemesh.core.families.family import GGUF, Family, WeightNames


def _refuse(raw: dict[str, Any]) -> str | None:
    rope = raw.get("rope_scaling") or raw.get("rope_parameters") or {}  # as stagemesh.core.model_config reads them
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ("default", None):
        return f"rope scaling {kind!r} (Phi-3's long-context RoPE)"
    partial = float(rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)))
    if partial != 1.0:
        return f"partial_rotary_factor {partial}"
    return None


FAMILY = Family("phi3", ("Phi3ForCausalLM",), weights=WeightNames(fused_qkv="qkv_proj", fused_gate_up="gate_up_proj"),
                gguf=GGUF("phi3", tensor_names=(("self_attn.qkv_proj.weight", "attn_qkv.weight"),
                                                ("mlp.gate_up_proj.weight", "ffn_up.weight"))),
                refuse=_refuse)
