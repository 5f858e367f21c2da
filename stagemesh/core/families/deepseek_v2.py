"""DeepSeek-V2 (and V2-Lite): multi-head latent attention (MLA, stage_worker.mla) and DeepSeekMoE: routed experts
behind a softmax gate (greedy, or group-limited greedy), shared experts every token takes, and the first
`first_k_dense_replace` layers dense. deepseek_v3 is this family with V3's gate; both are declared here through
`Variant`, and read as transformers' DeepseekV2ForCausalLM / DeepseekV3ForCausalLM read their configs.

The paged KV cache holds MLA's latent: kv_lora_rank + qk_rope_head_dim values per token and layer (the compressed
KV and the rotated key every head shares), not K and V heads. ModelConfig sees it as one KV head of half the
latent, its two halves in the k and v tensors of a layer's cache (stage_worker.mla), so that what moves blocks
(sizing, the planner, host and disk tiers, disaggregated transfers, DCP) moves the latent as it moves any KV.

A quantized checkpoint (DeepSeek-V3's as published: block FP8, weight_scale_inv per 128x128 block) is read by its
quant method (stage_worker.quant_methods): attention's, the MLPs' and the experts' linears stay quantized, and
kv_b_proj, which latent attention reads as a matrix (W_UK, W_UV), is dequantized once at load (stage_worker.mla).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

from stagemesh.core.families.family import Experts, Family, ModelConfigView, Shapes, WeightNames


@dataclass(frozen=True)
class Variant:
    """What differs between DeepSeek-V2 and V3 as transformers implements them."""

    defaults: dict[str, Any]  # transformers' config defaults, for a config.json that leaves a field out
    scoring_funcs: tuple[str, ...]  # the gate's scores: softmax (V2) or sigmoid (V3)
    topk_methods: tuple[str, ...]  # how the gate picks (V3 records its one method as noaux_tc)
    correction_bias: bool  # V3: e_score_correction_bias, added to the scores to choose experts (not to weigh them)
    rope_interleave: bool | None  # None: the config's rope_interleave says (V3); else always this (V2 interleaves)
    norm_topk_prob: bool  # whether transformers honours norm_topk_prob (V3); V2's code never renormalises


V2 = Variant(defaults=dict(first_k_dense_replace=0, kv_lora_rank=512, q_lora_rank=1536, qk_nope_head_dim=128,
                           qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=64, n_shared_experts=2,
                           moe_intermediate_size=1407, routed_scaling_factor=1.0, topk_method="greedy",
                           norm_topk_prob=False),
             scoring_funcs=("softmax",), topk_methods=("greedy", "group_limited_greedy"), correction_bias=False,
             rope_interleave=True, norm_topk_prob=False)


@dataclass(frozen=True)
class MLADims:
    """Multi-head latent attention's sizes, per head unless said."""

    q_lora_rank: int | None  # None: q_proj straight from the hidden states (V2-Lite)
    kv_lora_rank: int  # the compressed KV every head expands from
    qk_nope_head_dim: int
    qk_rope_head_dim: int  # the rotated part of q and k; k's is one for every head
    v_head_dim: int
    rope_interleave: bool  # rotary pairs adjacent (x0, x1), (x2, x3) ... rather than rotate-half
    softmax_scale: float  # qk_head_dim ** -0.5, times YaRN's mscale(factor, mscale_all_dim) squared

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Values the cache holds per token and layer."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class GateSettings:
    """How DeepSeekMoE's gate routes a token (stage_worker.grouped_gate)."""

    scoring_func: str  # softmax | sigmoid
    topk_method: str  # greedy | group_limited_greedy | noaux_tc
    n_group: int  # the experts in n_group groups of equal size
    topk_group: int  # the groups a token may pick from (grouped methods)
    routed_scaling_factor: float  # the routed experts' weights times this
    correction_bias: bool  # e_score_correction_bias in the checkpoint (V3)


@dataclass(frozen=True)
class DeepseekFamily(Family):
    variant: Variant = V2

    def attention_shapes(self, prefix: str, cfg: ModelConfigView) -> Shapes:
        d, h, heads = mla_dims(cfg), cfg.hidden_size, cfg.num_attention_heads
        shapes: Shapes
        if d.q_lora_rank is None:
            shapes = {f"{prefix}.q_proj.weight": (heads * d.qk_head_dim, h)}
        else:
            shapes = {f"{prefix}.q_a_proj.weight": (d.q_lora_rank, h),
                      f"{prefix}.q_a_layernorm.weight": (d.q_lora_rank,),
                      f"{prefix}.q_b_proj.weight": (heads * d.qk_head_dim, d.q_lora_rank)}
        return {**shapes, f"{prefix}.kv_a_proj_with_mqa.weight": (d.latent_dim, h),
                f"{prefix}.kv_a_layernorm.weight": (d.kv_lora_rank,),
                f"{prefix}.kv_b_proj.weight": (heads * (d.qk_nope_head_dim + d.v_head_dim), d.kv_lora_rank),
                f"{prefix}.o_proj.weight": (h, heads * d.v_head_dim)}

    def layer_shapes(self, cfg: ModelConfigView, index: int, sparse: bool) -> Shapes:
        shapes = super().layer_shapes(cfg, index, sparse)
        if sparse and self.variant.correction_bias:
            shapes[f"model.layers.{index}.mlp.gate.e_score_correction_bias"] = (cfg.num_experts,)
        return shapes


def _get(variant: Variant, raw: dict[str, Any], key: str) -> Any:
    return raw[key] if key in raw else variant.defaults.get(key)


def _rope(raw: dict[str, Any]) -> dict[str, Any]:
    rope = dict(raw.get("rope_scaling") or raw.get("rope_parameters") or {})
    rope.setdefault("rope_type", rope.pop("type", "default"))
    return rope


def _refuse(variant: Variant, raw: dict[str, Any]) -> str | None:
    def get(key: str) -> Any:
        return _get(variant, raw, key)

    for switch in ("attention_bias", "mlp_bias"):
        if raw.get(switch):
            return f"{switch} (biases on the attention or MLP projections)"
    heads, kv_heads = raw.get("num_attention_heads"), raw.get("num_key_value_heads")
    if kv_heads not in (None, heads):
        return f"num_key_value_heads {kv_heads} (MLA expands the latent into all {heads} heads)"
    rope, latent = _rope(raw), int(get("kv_lora_rank")) + int(get("qk_rope_head_dim"))
    if rope["rope_type"] not in ("default", "yarn"):
        return f"rope scaling {rope['rope_type']!r} (MLA takes default and yarn)"
    if int(get("qk_rope_head_dim")) % 2 or latent % 2:
        return f"qk_rope_head_dim {get('qk_rope_head_dim')} with kv_lora_rank {get('kv_lora_rank')} (both even)"
    if variant.rope_interleave is not None and raw.get("rope_interleave", variant.rope_interleave) \
            != variant.rope_interleave:
        return f"rope_interleave {raw['rope_interleave']} (this family's rotary pairs are always interleaved)"
    for key, want in (("moe_layer_freq", 1), ("ep_size", 1)):
        if raw.get(key, want) != want:
            return f"{key} {raw[key]} (every layer from first_k_dense_replace on is sparse, as transformers builds it)"
    if get("norm_topk_prob") and not variant.norm_topk_prob:
        return "norm_topk_prob true (transformers' DeepseekV2 never renormalises the top-k weights)"
    return _refuse_gate(variant, get)


def _refuse_gate(variant: Variant, get) -> str | None:
    scoring, method = get("scoring_func") or variant.scoring_funcs[0], get("topk_method") or variant.topk_methods[0]
    if scoring not in variant.scoring_funcs:
        return f"scoring_func {scoring!r} (this family's gate scores by {' or '.join(variant.scoring_funcs)})"
    if method not in variant.topk_methods:
        return f"topk_method {method!r} (this family's gate picks by {' or '.join(variant.topk_methods)})"
    experts, top_k = int(get("n_routed_experts") or 0), int(get("num_experts_per_tok") or 0)
    if experts < 1:
        return "n_routed_experts 0 (DeepSeekMoE without routed experts)"
    if method == "greedy":
        return None
    groups, topk_group = int(get("n_group") or 0), int(get("topk_group") or 0)
    per_group = experts // groups if groups else 0
    if groups < 1 or experts % groups or not 1 <= topk_group <= groups or top_k > topk_group * per_group \
            or (variant.correction_bias and per_group < 2):
        return (f"n_group {groups} with topk_group {topk_group} over {experts} experts, top-{top_k} (the groups must "
                "split the experts evenly, each of two or more under V3's gate, and hold the top-k)")
    return None


def _fields(variant: Variant, raw: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig's view: one KV head of half the latent (module docstring), the routed and shared experts under
    DeepSeek's names, and the dense first layers."""
    def get(key: str) -> Any:
        return _get(variant, raw, key)

    moe_inter = int(get("moe_intermediate_size"))
    dense = min(int(get("first_k_dense_replace") or 0), int(raw["num_hidden_layers"]))
    return dict(num_key_value_heads=1, head_dim=(int(get("kv_lora_rank")) + int(get("qk_rope_head_dim"))) // 2,
                num_experts=int(get("n_routed_experts")), moe_intermediate_size=moe_inter,
                shared_expert_intermediate_size=moe_inter * int(get("n_shared_experts") or 0),
                mlp_only_layers=tuple(range(dense)), decoder_sparse_step=1,
                norm_topk_prob=bool(get("norm_topk_prob")) and variant.norm_topk_prob)


def _family(cfg: ModelConfigView) -> DeepseekFamily:
    family = cfg.family
    if not isinstance(family, DeepseekFamily):
        raise TypeError(f"{cfg.model_type} is not a DeepSeek family")
    return family


def mla_dims(cfg: ModelConfigView) -> MLADims:
    variant = _family(cfg).variant

    def get(key: str) -> Any:
        return _get(variant, cfg.raw, key)

    q_lora = get("q_lora_rank")
    nope, rope_dim = int(get("qk_nope_head_dim")), int(get("qk_rope_head_dim"))
    interleave = variant.rope_interleave if variant.rope_interleave is not None else bool(get("rope_interleave"))
    return MLADims(None if q_lora is None else int(q_lora), int(get("kv_lora_rank")), nope, rope_dim,
                   int(get("v_head_dim")), interleave, _softmax_scale(nope + rope_dim, cfg.rope_scaling))


def _softmax_scale(qk_head_dim: int, rope: dict[str, Any] | None) -> float:
    """transformers' yarn_apply_mscale: YaRN's mscale_all_dim scales the softmax (its mscale scales cos and sin)."""
    scale = qk_head_dim ** -0.5
    if rope and rope.get("mscale_all_dim") and float(rope["factor"]) > 1:
        mscale = 0.1 * float(rope["mscale_all_dim"]) * math.log(float(rope["factor"])) + 1.0
        scale *= mscale * mscale
    return scale


def gate_settings(cfg: ModelConfigView) -> GateSettings:
    variant = _family(cfg).variant

    def get(key: str) -> Any:
        return _get(variant, cfg.raw, key)

    method = get("topk_method") or variant.topk_methods[0]
    grouped = method != "greedy"
    return GateSettings(get("scoring_func") or variant.scoring_funcs[0], method,
                        int(get("n_group")) if grouped else 1, int(get("topk_group")) if grouped else 1,
                        float(get("routed_scaling_factor") or 1.0), variant.correction_bias)


def make_family(model_type: str, architecture: str, variant: Variant, mtp_layers: str | None = None) -> DeepseekFamily:
    return DeepseekFamily(model_type, (architecture,), experts=Experts(shared="shared_experts", shared_gate=False,
                                                                       router="grouped"),
                          weights=WeightNames(), fused_cpu_plan=False, attention="mla",
                          refuse=functools.partial(_refuse, variant), fields=functools.partial(_fields, variant),
                          mtp_layers=mtp_layers, variant=variant)


FAMILY = make_family("deepseek_v2", "DeepseekV2ForCausalLM", V2)
