"""gpt-oss's decoder (stagemesh.core.families.gpt_oss): where its layers differ from Llama's.

- attention: q/k/v biases (the merged column-parallel linear's), an o_proj bias added once after the
  row-parallel reduction, a learned sink logit per head (each TP rank its heads'), and on the layers that
  layer_types names sliding_attention a window (kernels.masked_attention runs both);
- a mixture of experts: the router (a biased linear) keeps each token's top-k logits and softmaxes them; each
  expert is gate_up = x W + b (gate and up interleaved column by column), gate clamped above at the limit, up
  clamped both sides, (up + 1) * gate * sigmoid(alpha * gate), then down with its bias. Written out expert by
  expert in torch (the fused MoE kernels compute SiLU's); TP splits every expert's intermediate columns, the
  down bias joins on TP rank 0 before the reduction. The published checkpoint's experts stay MXFP4, each
  dequantised for the product of a step that routes tokens to it (stage_worker.quant_methods.mxfp4). With
  --enable-expert-parallel each TP rank holds whole experts instead (a contiguous num_experts / TP of them, every
  column, each with its down bias), computes the tokens routed to them, and the ranks' sums meet as TP's do.
  EPLB and expert parallelism across replicas are not built for it.

Norms, the residual stream, embeddings and the LM head are Llama's; the rotary table is the model's (YaRN)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

import kernels
from kernels.masked_attention import AttentionMask
from stage_worker.layers import Module, RMSNorm, Shard, full, new_param
from stage_worker.attention_metadata import AttentionMetadata
from stage_worker.model import Attention, StageModel
from stage_worker.parallel import HeadShard, StageParallel, TPGroup, shard_range
from stage_worker.quant_methods.mxfp4 import packed_experts
from stagemesh.core.errors import StagemeshError
from stagemesh.core.families.gpt_oss import layer_types
from stagemesh.core.model_config import ModelConfig


class GptOssAttention(Attention):
    def __init__(self, cfg: ModelConfig, prefix: str, tp: TPGroup, dtype, device, window: int | None):
        super().__init__(cfg, prefix, tp, dtype, device)
        shard = HeadShard.for_rank(cfg, tp)
        self.o_bias = new_param((cfg.hidden_size,), dtype, device, full(f"{prefix}.o_proj.bias", cfg.hidden_size))
        self.sinks = new_param((shard.num_heads,), dtype, device,
                               [Shard(f"{prefix}.sinks", 0, shard.q_start, shard.num_heads, 0)])
        self.window = window  # None: a full-attention layer

    def forward(self, x: torch.Tensor, meta: AttentionMetadata, kv_cache: tuple[torch.Tensor, torch.Tensor],
                cos_sin: torch.Tensor) -> torch.Tensor:
        tokens, qkv, s = x.shape[0], self.qkv_proj(x), self.kv_scale  # s: an fp8 cache's (stage_worker.kv_scales)
        if not s.calibrating:
            q = kernels.rotary_and_cache(qkv, self.num_heads, self.num_kv_heads, meta.positions, cos_sin, *kv_cache,
                                         meta.slot_mapping, s.k, s.v)
        else:  # the keys and values set the scales before any is written
            q, k, v = self._rotated(qkv, meta, cos_sin)
            kernels.write_kv_cache(k, v, *kv_cache, meta.slot_mapping, s.k, s.v)
        out = kernels.paged_attention(q, *kv_cache, meta.block_tables, meta.context_lens, meta.query_start_loc,
                                      self.scale, s.k, s.v, mask=AttentionMask(window=self.window, sinks=self.sinks))
        return self.o_proj(out.reshape(tokens, self.num_heads * self.head_dim)) + self.o_bias


class GptOssExperts(Module):
    """The router and every expert: this TP rank's columns of each, or (expert parallel) its whole experts."""

    def __init__(self, cfg: ModelConfig, prefix: str, tp: TPGroup, dtype, device, expert_parallel: bool = False):
        super().__init__()
        self.tp, self.top_k = tp, cfg.num_experts_per_tok
        num, h = cfg.num_experts, cfg.hidden_size
        if expert_parallel:  # whole experts [first, first + local), every column
            first, local = shard_range(num, tp, f"the experts of {prefix} (--enable-expert-parallel)")
            start, per = 0, cfg.intermediate_size
        else:  # every expert, this rank's share of the columns
            first, local = 0, num
            start, per = shard_range(cfg.intermediate_size, tp, f"the experts' intermediate size of {prefix}")
        self.first, self.local, self.expert_parallel = first, local, expert_parallel
        self.alpha, self.limit = float(cfg.raw.get("swiglu_alpha", 1.702)), float(cfg.raw.get("swiglu_limit", 7.0))
        self.router_weight = new_param((num, h), dtype, device, full(f"{prefix}.router.weight", num))
        self.router_bias = new_param((num,), dtype, device, full(f"{prefix}.router.bias", num))
        e = f"{prefix}.experts"  # gate and up interleaved: this rank's pairs of columns are contiguous
        # the published checkpoint's MXFP4 experts, kept packed (each dequantised at use); else bf16
        self.packed = packed_experts(cfg, e, start, per, device, first, local)

        def stacked(name: str, shape: tuple[int, ...], dim: int, col_start: int, cols: int) -> torch.nn.Parameter:
            shard = Shard(f"{e}.{name}", 0, first, local, 0) if expert_parallel else \
                Shard(f"{e}.{name}", dim, col_start, cols, 0)
            return new_param((local, *shape), dtype, device, [shard])

        if self.packed is None:
            self.gate_up = stacked("gate_up_proj", (h, 2 * per), 2, 2 * start, 2 * per)
            self.down = stacked("down_proj", (per, h), 1, start, per)
        self.gate_up_bias = stacked("gate_up_proj_bias", (2 * per,), 1, 2 * start, 2 * per)
        self.down_bias = new_param((local, h), dtype, device, [Shard(f"{e}.down_proj_bias", 0, first, local, 0)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        top, chosen = torch.topk(F.linear(x, self.router_weight, self.router_bias), self.top_k, dim=-1)
        weights = top.softmax(-1)
        out = torch.zeros_like(x)
        for expert in chosen.unique().tolist():
            e = expert - self.first  # (its index among this rank's experts)
            if not 0 <= e < self.local:  # (expert parallel: another rank's)
                continue
            rows, slot = torch.where(chosen == expert)
            gate_up_of, down_of = self._weights(e, x.dtype)
            gate_up = gate_up_of(x[rows]) + self.gate_up_bias[e]
            gate = gate_up[..., ::2].clamp(max=self.limit)
            up = gate_up[..., 1::2].clamp(-self.limit, self.limit)
            y = down_of((up + 1) * (gate * torch.sigmoid(gate * self.alpha)))
            if self.expert_parallel or self.tp.rank == 0:  # (the bias once, before the ranks' partial sums meet)
                y = y + self.down_bias[e]
            out.index_add_(0, rows, y * weights[rows, slot, None])
        return self.tp.all_reduce(out) if self.tp.size > 1 else out

    def _weights(self, expert: int, dtype: torch.dtype):
        """Expert `expert`'s gate_up and down products (MXFP4: its weights dequantised for this step only)."""
        if self.packed is None:
            gate_up, down = self.gate_up[expert], self.down[expert]
            return (lambda x: x @ gate_up), (lambda y: y @ down)
        gate_up, down = self.packed.expert(expert, dtype)
        return (lambda x: F.linear(x, gate_up)), (lambda y: F.linear(y, down))


class GptOssDecoderLayer(Module):
    sparse = False  # (its experts are its own: not stage_worker.moe's)
    cpu_plan = False

    def __init__(self, cfg: ModelConfig, index: int, tp: TPGroup, dtype, device, expert_parallel: bool = False):
        super().__init__()
        prefix, h, eps = f"model.layers.{index}", cfg.hidden_size, cfg.rms_norm_eps
        window = cfg.sliding_window if layer_types(cfg.raw)[index] == "sliding_attention" else None
        self.input_layernorm = RMSNorm(f"{prefix}.input_layernorm.weight", h, eps, dtype, device)
        self.self_attn = GptOssAttention(cfg, f"{prefix}.self_attn", tp, dtype, device, window)
        self.post_attention_layernorm = RMSNorm(f"{prefix}.post_attention_layernorm.weight", h, eps, dtype, device)
        self.mlp = GptOssExperts(cfg, f"{prefix}.mlp", tp, dtype, device, expert_parallel)

    def forward(self, x, residual, meta, kv_cache, cos_sin):
        x, residual = kernels.rms_norm(x, self.input_layernorm.weight, self.input_layernorm.eps, residual)
        x = self.self_attn(x, meta, kv_cache, cos_sin)
        x, residual = kernels.rms_norm(x, self.post_attention_layernorm.weight, self.post_attention_layernorm.eps,
                                       residual)
        return self.mlp(x), residual


class GptOssStageModel(StageModel):
    cuda_graphs = False  # its attention (kernels.masked_attention) and experts read step sizes on the host

    def __init__(self, cfg: ModelConfig, layer_start: int, layer_end: int, parallel: StageParallel,
                 dtype: torch.dtype, device, max_positions: int | None = None):
        if parallel.ep is not None:
            raise StagemeshError("expert parallelism across data-parallel replicas is not built for gpt_oss yet: "
                                 "--enable-expert-parallel spreads its experts over one stage's TP ranks")
        if parallel.eplb is not None:
            raise StagemeshError("--enable-eplb is not built for gpt_oss yet: its experts are placed once, a "
                                 "contiguous num_experts / TP of them on each TP rank")
        if parallel.cp is not None:
            raise StagemeshError("context parallelism (-dcp, -pcp) is not built for gpt_oss yet")
        super().__init__(cfg, layer_start, layer_end, parallel, dtype, device, max_positions)

    def decoder_layer(self, cfg, index, parallel, dtype, device) -> Module:
        return GptOssDecoderLayer(cfg, index, parallel.tp, dtype, device, parallel.expert_parallel)


STAGE_MODEL = GptOssStageModel
