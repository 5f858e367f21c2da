"""DeepSeek-V3 (and R1): DeepSeek-V2's latent attention and DeepSeekMoE (stagemesh.core.families.deepseek_v2) with
V3's gate: sigmoid scores, e_score_correction_bias added to choose experts (never to weigh them), the best
topk_group of n_group groups (a group scored by its two best experts), the top-k renormalised (norm_topk_prob) and
scaled by routed_scaling_factor; rope_interleave as the config says. Its multi-token-prediction layer (the
checkpoint's layer num_hidden_layers) is not part of the model: speculation reads it (deepseek_mtp)."""
from stagemesh.core.families.deepseek_v2 import Variant, make_family

V3 = Variant(defaults=dict(first_k_dense_replace=3, kv_lora_rank=512, q_lora_rank=1536, qk_nope_head_dim=128,
                           qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=256, n_shared_experts=1,
                           moe_intermediate_size=2048, routed_scaling_factor=2.5, n_group=8, topk_group=4,
                           norm_topk_prob=True, rope_interleave=True, num_experts_per_tok=8),
             scoring_funcs=("sigmoid",), topk_methods=("noaux_tc",), correction_bias=True, rope_interleave=None,
             norm_topk_prob=True)

FAMILY = make_family("deepseek_v3", "DeepseekV3ForCausalLM", V3, mtp_layers="num_nextn_predict_layers")
