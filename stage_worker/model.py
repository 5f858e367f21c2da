"""A contiguous slice of a Llama-like decoder, of any family in stagemesh.core.families (what differs between
them, e.g. q/k norm, biases, weight names, experts: stage_worker.moe, is read from cfg.family).

The forward is the plain model; tensor parallelism comes from the layers'
shard-aware parameters (stage_worker.layers). Attention runs over the paged
KV cache through kernels.dispatch.
"""
from __future__ import annotations

import importlib

import torch
from torch import nn

import kernels
from stagemesh.core.model_config import ModelConfig
from stage_worker.layers import (MLP, Module, RMSNorm, ParallelLMHead, VocabParallelEmbedding, column_parallel,
                                 row_parallel)
from stage_worker import layer_plan
from stage_worker.kv_scales import KVScale
from stage_worker.mla import MLAttention
from stage_worker.moe import SparseMoeBlock
from stage_worker.parallel import HeadShard, StageParallel, TPGroup
from stage_worker.attention_metadata import AttentionMetadata
from stage_worker.context import CPMetadata


@layer_plan.covers
class Attention(Module):
    def __init__(self, cfg: ModelConfig, prefix: str, tp: TPGroup, dtype, device, cp: TPGroup | None = None):
        """`cp`: the group a sequence's KV is spread over (decode or prefill context parallelism), or None."""
        super().__init__()
        shard = HeadShard.for_rank(cfg, tp)
        d = self.head_dim = cfg.head_dim
        self.num_heads, self.num_kv_heads = shard.num_heads, shard.num_kv_heads
        self.scale = d ** -0.5
        self.cp = cp
        parts = cfg.family.weights.qkv(prefix, cfg, (shard.q_start * d, shard.num_heads * d),
                                       (shard.kv_start * d, shard.num_kv_heads * d))
        self.qkv_proj = column_parallel(parts, cfg.hidden_size, dtype, device, bias=cfg.attention_bias)
        self.o_proj = row_parallel(f"{prefix}.o_proj", cfg.hidden_size, shard.q_start * d, shard.num_heads * d,
                                   tp, dtype, device)
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None  # set with q_norm
        if cfg.qk_norm:
            self.q_norm = RMSNorm(f"{prefix}.q_norm.weight", d, cfg.rms_norm_eps, dtype, device)
            self.k_norm = RMSNorm(f"{prefix}.k_norm.weight", d, cfg.rms_norm_eps, dtype, device)
        # an fp8 cache's scales (the runner sets the layer's: stage_worker.kv_scales); a cache of the model's dtype
        # ignores them
        self.kv_scale = KVScale()

    @staticmethod
    def rotary_dim(cfg: ModelConfig) -> int:
        return cfg.head_dim

    def forward(self, x: torch.Tensor, meta: AttentionMetadata, kv_cache: tuple[torch.Tensor, torch.Tensor],
                cos_sin: torch.Tensor) -> torch.Tensor:
        tokens, d, s = x.shape[0], self.head_dim, self.kv_scale
        k_cache, v_cache = kv_cache
        qkv = self.qkv_proj(x)
        if meta.cp is not None:
            assert self.cp is not None, "context-parallel metadata reaches only a context-parallel stage's layers"
            attend = self._prefill_context_parallel if meta.cp.pad else self._context_parallel
            return self.o_proj(attend(qkv, meta, meta.cp, self.cp, kv_cache, cos_sin))
        if self.q_norm is None and not s.calibrating:
            q = kernels.rotary_and_cache(qkv, self.num_heads, self.num_kv_heads, meta.positions, cos_sin, k_cache,
                                         v_cache, meta.slot_mapping, s.k, s.v)
        else:  # q and k normed per head before the rotation, or the keys calibrating the scales first
            q, k, v = self._rotated(qkv, meta, cos_sin)
            kernels.write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping, s.k, s.v)
        out = kernels.paged_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens,
                                      meta.query_start_loc, self.scale, s.k, s.v)
        return self.o_proj(out.reshape(tokens, self.num_heads * d))

    def _rotated(self, qkv: torch.Tensor, meta: AttentionMetadata, cos_sin: torch.Tensor):
        """q, k and v of the step's tokens, q and k rotated; the first forward of --calculate-kv-scales takes the
        layer's scales from these k and v (stage_worker.kv_scales) before any of them is written."""
        tokens, d = qkv.shape[0], self.head_dim
        q, k, v = qkv.split([self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d], -1)
        q, k, v = q.view(tokens, -1, d), k.view(tokens, -1, d), v.view(tokens, -1, d)
        if self.q_norm is not None and self.k_norm is not None:  # q and k normed per head before the rotation
            q = kernels.rms_norm(q, self.q_norm.weight, self.q_norm.eps)[0]
            k = kernels.rms_norm(k, self.k_norm.weight, self.k_norm.eps)[0]
        q, k = kernels.apply_rotary(q, k, meta.positions, cos_sin)
        if self.kv_scale.calibrating:
            self.kv_scale.calibrate(k, v)
        return q, k, v

    def _context_parallel(self, qkv: torch.Tensor, meta: AttentionMetadata, share: CPMetadata, cp: TPGroup,
                          kv_cache: tuple[torch.Tensor, torch.Tensor], cos_sin: torch.Tensor) -> torch.Tensor:
        """Decode context parallelism (vLLM's DCP): this rank keeps its share of the tokens' K and V; the DCP
        group's queries (the heads of these KV heads) attend to each rank's share, and the partial outputs are
        merged by their log-sum-exps, each rank keeping its own heads."""
        tokens, d, h = qkv.shape[0], self.head_dim, self.num_heads
        q, k, v = self._rotated(qkv, meta, cos_sin)
        self._write_held(k, v, share, kv_cache, self.kv_scale)
        group = cp.cp_gather(q)  # [dcp, tokens, h, d]: the group's query heads
        parts = self._partials(group.transpose(0, 1).reshape(tokens, -1, d), meta, share, cp, kv_cache)
        return self._merged(parts[:, :, cp.cp_rank * h:(cp.cp_rank + 1) * h], qkv.dtype).reshape(tokens, h * d)

    def _prefill_context_parallel(self, qkv: torch.Tensor, meta: AttentionMetadata, share: CPMetadata, cp: TPGroup,
                                  kv_cache: tuple[torch.Tensor, torch.Tensor], cos_sin: torch.Tensor) -> torch.Tensor:
        """Prefill context parallelism (vLLM's PCP, stage_worker.context.TokenSplit): this rank's tokens, every
        head. It keeps their K and V; every rank's queries (padded to share.pad rows each) attend to each rank's
        share of the keys, and each rank merges the partials of its own rows."""
        tokens, d, h = qkv.shape[0], self.head_dim, self.num_heads  # (tokens: share.pad rows)
        q, k, v = self._rotated(qkv, meta, cos_sin)
        self._write_held(k, v, share, kv_cache, self.kv_scale)
        queries = cp.cp_gather(q).view(-1, h, d)  # [ranks * pad, h, d]
        parts = self._partials(queries, meta, share, cp, kv_cache)  # [ranks, ranks * pad, h, d + 1]
        first = cp.cp_rank * share.pad
        return self._merged(parts[:, first:first + tokens], qkv.dtype).reshape(tokens, h * d)

    @staticmethod
    def _write_held(k: torch.Tensor, v: torch.Tensor, share: CPMetadata, kv_cache: tuple[torch.Tensor, torch.Tensor],
                    s: KVScale) -> None:
        if share.held.numel():
            kernels.write_kv_cache(k.index_select(0, share.held), v.index_select(0, share.held), *kv_cache,
                                   share.slot_mapping, s.k, s.v)

    def _partials(self, queries: torch.Tensor, meta: AttentionMetadata, share: CPMetadata, cp: TPGroup,
                  kv_cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Each rank's attention of `queries` over its share of the keys, with its lse as one more fp32 column
        (one collective for both), from every rank of the group: [ranks, rows, heads, head_dim + 1]."""
        out, lse = kernels.paged_attention_rows_lse(queries, *kv_cache, meta.block_tables, share.row_seqs,
                                                    share.row_visible, self.scale, self.kv_scale.k, self.kv_scale.v)
        return cp.cp_gather(torch.cat([out.float(), lse[..., None]], -1))

    @staticmethod
    def _merged(parts: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        merged, _ = kernels.merge_attention_states(parts[..., :-1].contiguous(), parts[..., -1].contiguous())
        return merged.to(dtype)


def attention_class(cfg: ModelConfig) -> type[Attention] | type[MLAttention]:
    """The family's attention: multi-head over K and V heads, or DeepSeek's latent attention (stage_worker.mla)."""
    return MLAttention if cfg.family.attention == "mla" else Attention


class DecoderLayer(Module):
    def __init__(self, cfg: ModelConfig, index: int, tp: TPGroup, dtype, device, expert_parallel: bool = False,
                 ep=None, eplb=None, cp: TPGroup | None = None):
        super().__init__()
        prefix = f"model.layers.{index}"
        eps = cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(f"{prefix}.input_layernorm.weight", cfg.hidden_size, eps, dtype, device)
        self.self_attn = attention_class(cfg)(cfg, f"{prefix}.self_attn", tp, dtype, device, cp)
        self.post_attention_layernorm = RMSNorm(f"{prefix}.post_attention_layernorm.weight", cfg.hidden_size, eps,
                                                dtype, device)
        self.sparse = cfg.is_sparse_layer(index)
        # whether stage_worker.layer_plan may run it (its attention is a whole rank's: not DCP's)
        self.cpu_plan = cfg.family.fused_cpu_plan and cp is None
        self.mlp: SparseMoeBlock | MLP
        if self.sparse:
            self.mlp = SparseMoeBlock(cfg, index, tp, expert_parallel, dtype, device, ep, eplb)
        else:
            self.mlp = MLP(f"{prefix}.mlp", cfg.hidden_size, cfg.intermediate_size, tp, dtype, device,
                           names=cfg.family.weights)

    def forward(self, x, residual, meta, kv_cache, cos_sin):
        plan = self.__dict__.get("_plan")
        if plan is None or plan.stale():
            plan = self.__dict__["_plan"] = layer_plan.build(self)  # not setattr: that would count as a change
        if plan.runs(x, kv_cache):  # the same kernels from C++ (stage_worker/layer_plan.py)
            return plan(x, residual, meta, kv_cache, cos_sin)
        x, residual = kernels.rms_norm(x, self.input_layernorm.weight, self.input_layernorm.eps, residual)
        x = self.self_attn(x, meta, kv_cache, cos_sin)
        x, residual = kernels.rms_norm(x, self.post_attention_layernorm.weight, self.post_attention_layernorm.eps,
                                       residual)
        return (self.mlp(x, meta) if self.sparse else self.mlp(x)), residual


class StageModel(Module):
    """Layers [layer_start, layer_end) of one TP rank, plus embeddings (first) or norm + LM head (last)."""
    cuda_graphs = True  # its decode steps may be captured (no host synchronisation in its forward)

    def __init__(self, cfg: ModelConfig, layer_start: int, layer_end: int, parallel: StageParallel,
                 dtype: torch.dtype, device: str | torch.device, max_positions: int | None = None):
        super().__init__()
        tp, ep = parallel.tp, parallel.ep
        self.cfg = cfg
        self.layer_start, self.layer_end = layer_start, layer_end
        self.is_first = layer_start == 0
        self.is_last = layer_end == cfg.num_hidden_layers
        # the first stage's embeddings, the last stage's norm and LM head
        self.embed_tokens: VocabParallelEmbedding | None = None
        self.norm: RMSNorm | None = None
        self.lm_head: ParallelLMHead | None = None
        if self.is_first:
            self.embed_tokens = VocabParallelEmbedding("model.embed_tokens.weight", cfg.vocab_size, cfg.hidden_size,
                                                       tp, dtype, device)
        self.layers = nn.ModuleList(self.decoder_layer(cfg, i, parallel, dtype, device)
                                    for i in range(layer_start, layer_end))
        if ep is not None:  # a member without rows of its own runs these (stage_worker.ep_group)
            ep.attach([layer.mlp for layer in self.layers if layer.sparse], cfg.hidden_size, dtype)
        if self.is_last:
            self.norm = RMSNorm("model.norm.weight", cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
            head = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
            self.lm_head = ParallelLMHead(head, cfg.vocab_size, cfg.hidden_size, tp, dtype, device)
        # each layer's KV cache group (stagemesh.core.kv_groups: the stage runner sets them; one group by default)
        self.kv_groups: tuple[int, ...] = (0,) * len(self.layers)
        positions = max_positions or cfg.max_position_embeddings
        self.register_buffer("cos_sin", kernels.build_cos_sin_cache(
            attention_class(cfg).rotary_dim(cfg), positions, cfg.rope_theta, cfg.rope_scaling, dtype=torch.float32,
            device=device),
            persistent=False)

    def decoder_layer(self, cfg: ModelConfig, index: int, parallel: StageParallel, dtype, device) -> Module:
        """Decoder layer `index` (a family's own stage model makes its own: build())."""
        p = parallel
        return DecoderLayer(cfg, index, p.tp, dtype, device, p.expert_parallel, p.ep, p.eplb, p.cp)

    def forward(self, input_ids: torch.Tensor | None, hidden: torch.Tensor | None, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Embeds (first stage) or continues from `hidden`; returns the residual stream
        (non-last stages) or the final normed hidden states (last stage)."""
        x = self.embed_tokens(input_ids) if self.embed_tokens is not None else hidden  # is_first
        assert x is not None, "a stage after the first continues from the hidden states it is sent"
        residual = None
        for layer, kv_cache, group in zip(self.layers, kv_caches, self.kv_groups):
            x, residual = layer(x, residual, meta.of_group(group), kv_cache, self.cos_sin)
        if self.norm is not None:  # is_last
            return kernels.rms_norm(x, self.norm.weight, self.norm.eps, residual)[0]
        return x + residual if residual is not None else x  # one tensor crosses to the next stage

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        assert self.lm_head is not None, "only the last stage (it holds the LM head) computes logits"
        return self.lm_head(hidden).float()

    def num_parameter_bytes(self) -> int:
        from stage_worker.quant_weight import QuantizedWeight

        quantised = sum(m.nbytes() for m in self.modules() if isinstance(m, QuantizedWeight))
        return sum(p.numel() * p.element_size() for p in self.parameters()) + quantised


def build(cfg: ModelConfig, layer_start: int, layer_end: int, tp: TPGroup, dtype: torch.dtype,
          device: str | torch.device, *, expert_parallel: bool = False, ep=None, eplb=None,
          cp: TPGroup | None = None) -> StageModel:
    """The stage model of cfg's family: StageModel, or the family's own (Family.stage_model: a stage_worker module
    whose STAGE_MODEL subclasses it) where its layers differ from the Llama-like decoder's. The parallel layout
    (stage_worker.parallel.StageParallel) is named field by field."""
    cls = StageModel
    if cfg.family.stage_model is not None:
        cls = importlib.import_module(cfg.family.stage_model).STAGE_MODEL
    parallel = StageParallel(tp, expert_parallel, ep, eplb, cp)
    return cls(cfg, layer_start, layer_end, parallel, dtype, device)
