"""Gemma 3's text decoder (stagemesh.core.families.gemma3): where its layers differ from the Llama-like one.

- RMSNorm scales by (1 + weight), computed in fp32 from the checkpoint's weight as transformers does (a
  weight of 1 + w stored in bf16 would lose w's low bits);
- sandwich norms: attention's output and the MLP's are normed before they join the residual stream, and a
  norm comes before the MLP as before attention;
- a GELU-tanh MLP; q and k RMSNormed per head; scores scaled by query_pre_attn_scalar**-0.5;
- local layers (layer_types sliding_attention) attend within sliding_window (kernels.masked_attention) and
  rotate with their own base (the config's sliding_attention rope, rope_local_base_freq in older configs);
  the global ones with the model's (stagemesh.core.model_config);
- embeddings scaled by sqrt(hidden_size) in the model's dtype; logits softcapped where the config says.

Tensor parallelism is Llama's (the same merged linears and shards); pipeline stages pass the residual stream
as every family does."""
from __future__ import annotations

import torch
import torch.nn.functional as F

import kernels
from kernels.masked_attention import AttentionMask
from stage_worker.layers import MLP, Module, RMSNorm
from stage_worker.attention_metadata import AttentionMetadata
from stage_worker.model import Attention, StageModel
from stage_worker.parallel import StageParallel, TPGroup
from stagemesh.core.errors import StagemeshError
from stagemesh.core.families.gemma3 import layer_types
from stagemesh.core.model_config import ModelConfig


def norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
         residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Gemma's RMSNorm (with the residual added first, in x's dtype, where one is given): the normed x and the
    residual stream."""
    if residual is not None:
        x = x + residual
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (1.0 + weight.float())).to(x.dtype), x


class GeluTanhMLP(MLP):
    """The gate through GELU (tanh approximation) times up, then down: Llama's merged, sharded linears."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class Gemma3Attention(Attention):
    def __init__(self, cfg: ModelConfig, prefix: str, tp: TPGroup, dtype, device, window: int | None):
        super().__init__(cfg, prefix, tp, dtype, device)
        self.scale = float(cfg.raw.get("query_pre_attn_scalar", 256)) ** -0.5
        self.window = window  # None: a global layer
        cap = cfg.raw.get("attn_logit_softcapping")
        self.softcap = float(cap) if cap else None

    def forward(self, x: torch.Tensor, meta: AttentionMetadata, kv_cache: tuple[torch.Tensor, torch.Tensor],
                cos_sin: torch.Tensor) -> torch.Tensor:
        tokens, d = x.shape[0], self.head_dim
        q, k, v = self.qkv_proj(x).split([self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d], -1)
        assert self.q_norm is not None and self.k_norm is not None  # (the family's qk_norm)
        q = norm(q.view(tokens, -1, d), self.q_norm.weight, self.q_norm.eps)[0]
        k = norm(k.view(tokens, -1, d), self.k_norm.weight, self.k_norm.eps)[0]
        q, k = kernels.apply_rotary(q, k, meta.positions, cos_sin)
        v, s = v.view(tokens, -1, d), self.kv_scale  # s: an fp8 cache's scales (stage_worker.kv_scales)
        if s.calibrating:
            s.calibrate(k, v)
        kernels.write_kv_cache(k, v, *kv_cache, meta.slot_mapping, s.k, s.v)
        mask = AttentionMask(window=self.window, softcap=self.softcap)
        out = kernels.paged_attention(q, *kv_cache, meta.block_tables, meta.context_lens, meta.query_start_loc,
                                      self.scale, s.k, s.v, mask=mask)
        return self.o_proj(out.reshape(tokens, self.num_heads * d))


class Gemma3DecoderLayer(Module):
    sparse = False  # (no experts)
    cpu_plan = False  # (the fused CPU layer is Llama's)

    def __init__(self, cfg: ModelConfig, index: int, tp: TPGroup, dtype, device):
        super().__init__()
        prefix, h, eps = f"model.layers.{index}", cfg.hidden_size, cfg.rms_norm_eps
        self.sliding = layer_types(cfg.raw)[index] == "sliding_attention"
        self.input_layernorm = RMSNorm(f"{prefix}.input_layernorm.weight", h, eps, dtype, device)
        self.post_attention_layernorm = RMSNorm(f"{prefix}.post_attention_layernorm.weight", h, eps, dtype, device)
        self.pre_feedforward_layernorm = RMSNorm(f"{prefix}.pre_feedforward_layernorm.weight", h, eps, dtype, device)
        self.post_feedforward_layernorm = RMSNorm(f"{prefix}.post_feedforward_layernorm.weight", h, eps, dtype,
                                                  device)
        self.self_attn = Gemma3Attention(cfg, f"{prefix}.self_attn", tp, dtype, device,
                                         cfg.sliding_window if self.sliding else None)
        self.mlp = GeluTanhMLP(f"{prefix}.mlp", h, cfg.intermediate_size, tp, dtype, device)

    def forward(self, x, residual, meta, kv_cache, cos_sin):
        """(the MLP's normed output, the residual stream before it): their sum is the layer's output, which the
        next layer's first norm adds up."""
        x, residual = norm(x, self.input_layernorm.weight, self.input_layernorm.eps, residual)
        x = self.self_attn(x, meta, kv_cache, cos_sin)
        x = norm(x, self.post_attention_layernorm.weight, self.post_attention_layernorm.eps)[0]
        x, residual = norm(x, self.pre_feedforward_layernorm.weight, self.pre_feedforward_layernorm.eps, residual)
        x = self.mlp(x)
        return norm(x, self.post_feedforward_layernorm.weight, self.post_feedforward_layernorm.eps)[0], residual


class Gemma3StageModel(StageModel):
    cuda_graphs = False  # its local layers' attention (kernels.masked_attention) reads step sizes on the host

    def __init__(self, cfg: ModelConfig, layer_start: int, layer_end: int, parallel: StageParallel,
                 dtype: torch.dtype, device, max_positions: int | None = None):
        if parallel.cp is not None:
            raise StagemeshError("context parallelism (-dcp, -pcp) is not built for gemma3_text yet: its local "
                                 "layers' window is not split over ranks")
        super().__init__(cfg, layer_start, layer_end, parallel, dtype, device, max_positions)
        theta, scaling = local_rope(cfg)
        self.register_buffer("cos_sin_local", kernels.build_cos_sin_cache(
            cfg.head_dim, max_positions or cfg.max_position_embeddings, theta, scaling, dtype=torch.float32,
            device=device), persistent=False)
        cap = cfg.raw.get("final_logit_softcapping")
        self.logit_softcap = float(cap) if cap else None

    def decoder_layer(self, cfg, index, parallel, dtype, device) -> Module:
        return Gemma3DecoderLayer(cfg, index, parallel.tp, dtype, device)

    def forward(self, input_ids, hidden, meta, kv_caches):
        if self.embed_tokens is not None:  # (the first stage) scaled as transformers does: fp32, then the dtype's
            x = self.embed_tokens(input_ids)
            x = x * torch.tensor(self.cfg.hidden_size ** 0.5).to(x.dtype)
        else:
            x = hidden
        residual = None
        for layer, kv_cache, group in zip(self.layers, kv_caches, self.kv_groups):
            x, residual = layer(x, residual, meta.of_group(group), kv_cache,
                                self.cos_sin_local if layer.sliding else self.cos_sin)
        if self.norm is not None:  # the last stage
            return norm(x, self.norm.weight, self.norm.eps, residual)[0]
        return x + residual if residual is not None else x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        if self.logit_softcap is not None:
            logits = torch.tanh(logits / self.logit_softcap) * self.logit_softcap
        return logits


def local_rope(cfg: ModelConfig) -> tuple[float, dict | None]:
    """The local layers' rotary base and scaling: the config's sliding_attention rope_parameters (transformers
    5), else rope_local_base_freq (older configs; 10,000 by default)."""
    params = dict((cfg.raw.get("rope_parameters") or {}).get("sliding_attention") or {})
    theta = float(params.pop("rope_theta", cfg.raw.get("rope_local_base_freq", 10000.0)))
    return theta, (params if params.get("rope_type", "default") != "default" else None)


STAGE_MODEL = Gemma3StageModel
