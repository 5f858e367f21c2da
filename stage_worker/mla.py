"""Multi-head latent attention (DeepSeek-V2 / V3: transformers' DeepseekV3Attention) over a paged cache of latents.

A token's hidden state gives a query per head (through q_lora_rank where the model has it) and one latent,
cat(c_kv, k_pe): c_kv (kv_lora_rank values, normed) compresses every head's unrotated key and its value, k_pe is
the rotated key all heads share. The cache keeps only the latent (kernels.mla_reference). Attention runs two ways,
as vLLM's and SGLang's MLA do:
- absorbed (decode rows): W_UK folded into the query (q_nope W_UK per head), scores taken against the latents
  themselves, and the weighted c_kv taken through W_UV after, so no step expands the context;
- expanded (prefill chunks): the context's latents expanded by kv_b_proj into K and V heads, then ordinary
  causal attention, cheaper than absorbed when the queries are as many as the keys (benchmarks/bench_mla.py).
Tensor parallelism splits the heads and replicates the latent on every rank (as vLLM does); with decode context
parallelism each rank of a DCP group keeps its share of the tokens' latents, and the group's absorbed partials
are merged by their log-sum-exps.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

import kernels
from kernels.reference import AttentionPlan, step_memo
from stagemesh.core.errors import StagemeshError
from stagemesh.core.families.deepseek_v2 import mla_dims
from stagemesh.core.model_config import ModelConfig
from stage_worker.layers import (Linear, Module, RMSNorm, Shard, column_parallel, dequantised_at_load, new_param,
                                 row_parallel)
from stage_worker.attention_metadata import AttentionMetadata
from stage_worker.context import CPMetadata
from stage_worker.parallel import HeadShard, TPGroup

# transformers builds q_a_layernorm and kv_a_layernorm with RMSNorm's default eps, not the config's rms_norm_eps
LATENT_NORM_EPS = 1e-6


class MLAttention(Module):
    # how decode rows and prefill chunks attend: absorbed or expanded (benchmarks/bench_mla.py measures both ways)
    absorb_decode = True
    absorb_prefill = False

    def __init__(self, cfg: ModelConfig, prefix: str, tp: TPGroup, dtype, device, cp: TPGroup | None = None):
        super().__init__()
        if cp is not None and cp.pcp:
            raise StagemeshError(f"--prefill-context-parallel-size with multi-head latent attention ({cfg.model_type})"
                                 " is not built yet (--decode-context-parallel-size is)")
        d = self.dims = mla_dims(cfg)
        shard = HeadShard.for_rank(cfg, tp)
        h = self.num_heads = shard.num_heads
        first, qk, kv_rows = shard.q_start, d.qk_head_dim, d.qk_nope_head_dim + d.v_head_dim
        self.scale, self.cp = d.softmax_scale, cp
        q_part = ((f"{prefix}.q_proj", first * qk, h * qk) if d.q_lora_rank is None
                  else (f"{prefix}.q_a_proj", 0, d.q_lora_rank))
        self.q_width = q_part[2]
        # the query's first projection and the latent's read the same hidden states: one product
        self.qkv_a_proj = column_parallel([q_part, (f"{prefix}.kv_a_proj_with_mqa", 0, d.latent_dim)],
                                          cfg.hidden_size, dtype, device)
        self.q_a_layernorm: RMSNorm | None = None
        self.q_b_proj: Linear | None = None
        if d.q_lora_rank is not None:
            self.q_a_layernorm = RMSNorm(f"{prefix}.q_a_layernorm.weight", d.q_lora_rank, LATENT_NORM_EPS, dtype,
                                         device)
            self.q_b_proj = column_parallel([(f"{prefix}.q_b_proj", first * qk, h * qk)], d.q_lora_rank, dtype, device)
        self.kv_a_layernorm = RMSNorm(f"{prefix}.kv_a_layernorm.weight", d.kv_lora_rank, LATENT_NORM_EPS, dtype, device)
        # this rank's heads of kv_b_proj, [heads x (nope + v), kv_lora_rank]: a plain parameter (never re-laid for
        # the CPU's products), read per head as W_UK (its nope rows) and W_UV (its v rows); a quantised checkpoint's
        # (DeepSeek-V3's block FP8) dequantised into it once at load, as vLLM and SGLang make W_UK and W_UV
        self.kv_b_proj = dequantised_at_load(new_param(
            (h * kv_rows, d.kv_lora_rank), dtype, device,
            [Shard(f"{prefix}.kv_b_proj.weight", 0, first * kv_rows, h * kv_rows, 0)]))
        self.o_proj = row_parallel(f"{prefix}.o_proj", cfg.hidden_size, first * d.v_head_dim, h * d.v_head_dim, tp,
                                   dtype, device)

    @staticmethod
    def rotary_dim(cfg: ModelConfig) -> int:
        return mla_dims(cfg).qk_rope_head_dim

    def forward(self, x: torch.Tensor, meta: AttentionMetadata, kv_cache: tuple[torch.Tensor, torch.Tensor],
                cos_sin: torch.Tensor) -> torch.Tensor:
        tokens, d = x.shape[0], self.dims
        q_nope, q_pe, latent = self._project(x, meta.positions, cos_sin)
        if meta.cp is not None:
            assert self.cp is not None, "context-parallel metadata reaches only a context-parallel stage's layers"
            out = self._context_parallel(q_nope, q_pe, latent, meta, meta.cp, self.cp, kv_cache)
        else:
            kernels.write_latent(latent, *kv_cache, meta.slot_mapping)
            out = self._attend(q_nope, q_pe, meta, kv_cache)
        return self.o_proj(out.reshape(tokens, self.num_heads * d.v_head_dim))

    def _project(self, x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor):
        """q_nope [tokens, heads, nope], q_pe rotated [tokens, heads, rope] and the latents [tokens, latent]."""
        tokens, d = x.shape[0], self.dims
        q, latent = self.qkv_a_proj(x).split([self.q_width, d.latent_dim], -1)
        if self.q_b_proj is not None and self.q_a_layernorm is not None:
            q = self.q_b_proj(kernels.rms_norm(q.contiguous(), self.q_a_layernorm.weight, self.q_a_layernorm.eps)[0])
        q_nope, q_pe = q.reshape(tokens, self.num_heads, d.qk_head_dim).split(
            [d.qk_nope_head_dim, d.qk_rope_head_dim], -1)
        c_kv, k_pe = latent.split([d.kv_lora_rank, d.qk_rope_head_dim], -1)
        c_kv = kernels.rms_norm(c_kv.contiguous(), self.kv_a_layernorm.weight, self.kv_a_layernorm.eps)[0]
        q_pe, k_pe = kernels.apply_rotary(self._halves(q_pe), self._halves(k_pe.reshape(tokens, 1, -1)), positions,
                                          cos_sin)
        return q_nope, q_pe, torch.cat([c_kv, k_pe.reshape(tokens, -1)], -1)

    def _halves(self, x: torch.Tensor) -> torch.Tensor:
        """The rotary dims in rotate-half order: interleaved pairs (x0, x1), (x2, x3) ... to (x0, x2, ... x1, x3, ...),
        as transformers' apply_rotary_pos_emb_interleave lays its output (the scores do not depend on the order)."""
        return torch.cat([x[..., 0::2], x[..., 1::2]], -1) if self.dims.rope_interleave else x.contiguous()

    def _attend(self, q_nope: torch.Tensor, q_pe: torch.Tensor, meta: AttentionMetadata,
                kv_cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """[tokens, heads, v]: decode rows absorbed in one batch, prefill chunks expanded one sequence at a time
        (absorbed too with absorb_prefill)."""
        plan = step_memo("attention", (meta.block_tables, meta.context_lens, meta.query_start_loc),
                         lambda: AttentionPlan(meta.context_lens, meta.query_start_loc))
        tables = meta.block_tables
        if plan.decode_rows is None:  # every row decodes
            return self._decode(q_nope, q_pe, kv_cache, tables, plan.decode_seqs, plan.decode_lens)
        out = q_nope.new_empty(*q_nope.shape[:2], self.dims.v_head_dim)
        if plan.decode_rows.numel():
            rows = plan.decode_rows
            out[rows] = self._decode(q_nope[rows], q_pe[rows], kv_cache, tables, plan.decode_seqs, plan.decode_lens)
        if self.absorb_prefill:
            rows, seqs, visible = _prefill_rows(plan.prefills, q_nope.device)
            out[rows] = self._absorbed(q_nope[rows], q_pe[rows], kv_cache, tables, seqs, visible)
            return out
        for seq, lo, hi, context_len in plan.prefills:
            out[lo:hi] = self._expanded(q_nope[lo:hi], q_pe[lo:hi], kv_cache, tables[seq], context_len)
        return out

    def _decode(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                block_tables: torch.Tensor, seqs: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
        """Decode rows, row i of sequence seqs[i] at the end of its lens[i] positions."""
        if self.absorb_decode:
            return self._absorbed(q_nope, q_pe, kv_cache, block_tables, seqs, lens)
        return torch.cat([self._expanded(q_nope[i:i + 1], q_pe[i:i + 1], kv_cache, block_tables[s], n)
                          for i, (s, n) in enumerate(zip(seqs.tolist(), lens.tolist()))])

    def _absorbed(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                  block_tables: torch.Tensor, row_seqs: torch.Tensor, row_visible: torch.Tensor) -> torch.Tensor:
        """Rows, each over the first row_visible latents of its sequence, absorbed: [rows, heads, v]."""
        out, _ = kernels.mla_attention_rows(self._absorbed_query(q_nope, q_pe), kv_cache[0], kv_cache[1], block_tables,
                                            row_seqs, row_visible, self.scale, self.dims.kv_lora_rank)
        return self._through_w_uv(out)

    def _absorbed_query(self, q_nope: torch.Tensor, q_pe: torch.Tensor) -> torch.Tensor:
        """cat(q_nope W_UK, q_pe) per head, [rows, heads, latent]: a query scored against the latents."""
        w_uk, _ = self._absorbing()
        return torch.cat([torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1), q_pe], -1)

    def _through_w_uv(self, latent_out: torch.Tensor) -> torch.Tensor:
        """[rows, heads, kv_lora_rank] -> [rows, heads, v]: each head's W_UV."""
        _, w_uv_t = self._absorbing()
        return torch.bmm(latent_out.transpose(0, 1).to(w_uv_t.dtype), w_uv_t).transpose(0, 1)

    def _absorbing(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK [heads, nope, kv_lora_rank] and W_UV transposed [heads, kv_lora_rank, v], contiguous (a strided
        view of kv_b_proj makes CPU products ~3x slower): made from kv_b_proj when first used after it is loaded,
        again whenever it changes. (Kept in the instance's dict: not a submodule or parameter of the layer.)"""
        key = (self.kv_b_proj.data_ptr(), self.kv_b_proj._version)
        made = self.__dict__.get("_w_absorbed")
        if made is None or made[0] != key:
            w = self.kv_b_proj.view(self.num_heads, -1, self.dims.kv_lora_rank)
            nope = self.dims.qk_nope_head_dim
            made = (key, w[:, :nope].contiguous(), w[:, nope:].transpose(1, 2).contiguous())
            self.__dict__["_w_absorbed"] = made
        return made[1], made[2]

    def _expanded(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                  block_table: torch.Tensor, context_len: int) -> torch.Tensor:
        """One sequence's rows (the last q_nope.shape[0] positions of its context_len) over its expanded context."""
        d, h = self.dims, self.num_heads
        latent = kernels.gather_latent(*kv_cache, block_table, context_len).to(q_nope.dtype)
        c_kv, k_pe = latent.split([d.kv_lora_rank, d.qk_rope_head_dim], -1)
        k_nope, value = F.linear(c_kv, self.kv_b_proj).view(context_len, h, -1).split(
            [d.qk_nope_head_dim, d.v_head_dim], -1)
        key = torch.cat([k_nope, k_pe[:, None].expand(context_len, h, d.qk_rope_head_dim)], -1)
        query, rows = torch.cat([q_nope, q_pe], -1), q_nope.shape[0]
        mask = None
        if rows > 1:  # query i sits at position context_len - rows + i and sees keys up to it
            positions = torch.arange(rows, device=query.device)[:, None] + context_len - rows
            mask = torch.arange(context_len, device=query.device)[None, :] <= positions
        out = F.scaled_dot_product_attention(query.transpose(0, 1)[None], key.transpose(0, 1)[None],
                                             value.transpose(0, 1)[None], attn_mask=mask, scale=self.scale)
        return out[0].transpose(0, 1)

    def _context_parallel(self, q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor,
                          meta: AttentionMetadata, share: CPMetadata, cp: TPGroup,
                          kv_cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Decode context parallelism over the latent (vLLM's DCP, built for MLA): this rank keeps its share of the
        tokens' latents; the DCP group's absorbed queries (each rank's heads) attend to each rank's share, and the
        partial weighted c_kv are merged by their lses, each rank keeping its own heads."""
        tokens, h = q_nope.shape[0], self.num_heads
        if share.held.numel():
            kernels.write_latent(latent.index_select(0, share.held), *kv_cache, share.slot_mapping)
        q = self._absorbed_query(q_nope, q_pe)
        queries = cp.cp_gather(q).transpose(0, 1).reshape(tokens, -1, q.shape[-1])  # [tokens, group's heads, latent]
        out, lse = kernels.mla_attention_rows(queries, kv_cache[0], kv_cache[1], meta.block_tables, share.row_seqs,
                                              share.row_visible, self.scale, self.dims.kv_lora_rank)
        parts = cp.cp_gather(torch.cat([out.float(), lse[..., None]], -1))[:, :, cp.cp_rank * h:(cp.cp_rank + 1) * h]
        merged, _ = kernels.merge_attention_states(parts[..., :-1].contiguous(), parts[..., -1].contiguous())
        return self._through_w_uv(merged.to(q_nope.dtype))


def _prefill_rows(prefills: list[tuple[int, int, int, int]], device) -> tuple[torch.Tensor, ...]:
    """The rows of a step's prefill chunks (AttentionPlan.prefills), their sequences, and how many positions each
    sees (its own and those before it)."""
    rows, seqs, visible = [], [], []
    for seq, lo, hi, context_len in prefills:
        rows.append(torch.arange(lo, hi))
        seqs.append(torch.full((hi - lo,), seq))
        visible.append(torch.arange(context_len - (hi - lo) + 1, context_len + 1))
    return tuple(torch.cat(x).to(device) for x in (rows, seqs, visible))
