"""One entry point per kernel: Triton on CUDA tensors, the fused C++ kernels on fp32 and bf16 CPU
tensors (where they could be built; the MoE layer's on fp32 only), the torch reference elsewhere.

STAGEMESH_KERNELS=torch|triton forces one (Triton on CPU needs TRITON_INTERPRET=1).

The KV cache's kernels take an fp8 cache too (--kv-cache-dtype fp8): k_scale and v_scale are its per-tensor
scales (kernels.kv_quant), which a cache of another dtype ignores.
"""
from __future__ import annotations

import functools
import os

import torch

from kernels import cpu_ops, masked_attention, mla_reference, moe_reference, quant_reference, reference
from kernels.kv_quant import is_fp8


# Read once: a process keeps one choice (the kernels are picked per call, so a lookup here is paid by
# every kernel of every layer of every step).
_FORCED = os.environ.get("STAGEMESH_KERNELS", "").lower()
_CPU_DTYPES = (torch.float32, torch.bfloat16)


def forced() -> str:
    """STAGEMESH_KERNELS as this process read it ("torch", "triton" or "")."""
    return _FORCED


def _use_triton(t: torch.Tensor) -> bool:
    if _FORCED in ("torch", "triton"):
        return _FORCED == "triton"
    return t.is_cuda


def _cpu_impl(t: torch.Tensor, dtypes=_CPU_DTYPES):
    """The fused CPU kernels for CPU tensors of these dtypes when they are built, else the reference."""
    if t.is_cpu and t.dtype in dtypes and cpu_ops.load() is not None:
        return cpu_ops
    return reference


def _triton():
    # imported lazily: CPU-only serving never needs triton
    from kernels import triton_ops

    return triton_ops


def write_kv_cache(k, v, k_cache, v_cache, slot_mapping, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    impl = _triton() if _use_triton(k) and _has("write_kv_cache") else _cpu_impl(k)
    impl.write_kv_cache(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def paged_attention(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale, k_scale: float = 1.0,
                    v_scale: float = 1.0, *, mask: masked_attention.AttentionMask = masked_attention.PLAIN):
    """Causal attention over the paged cache (an fp8 cache read as stored * k_scale / v_scale). A layer whose
    mask asks for a sliding window or attention sinks runs the fused CPU kernel where it covers the head_dim
    (kernels.cpu_ops.paged_attention_window); softcap, Triton and the rest run kernels.masked_attention's torch
    reference."""
    if not mask.is_plain:
        impl = None if _use_triton(q) or mask.softcap is not None else _cpu_impl(q)
        out = impl.paged_attention_window(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale,
                                          mask, k_scale, v_scale) if impl is cpu_ops else None
        if out is not None:
            return out
        return masked_attention.paged_attention_masked(q, k_cache, v_cache, block_tables, context_lens,
                                                       query_start_loc, scale, mask, k_scale=k_scale, v_scale=v_scale)
    impl = _triton() if _use_triton(q) and _has("paged_attention") else _cpu_impl(q)
    return impl.paged_attention(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale,
                                k_scale=k_scale, v_scale=v_scale)


def paged_attention_lse(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                        context_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float,
                        k_scale: float = 1.0, v_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """paged_attention and each (query row, head)'s log-sum-exp of its scaled scores, [tokens, heads] fp32: the
    partial result a context-parallel rank computes over its share of the keys (merge_attention_states)."""
    impl = _triton_attention() if _use_triton(q) and _has("paged_attention") else _cpu_impl(q)
    return impl.paged_attention_lse(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale,
                                    k_scale, v_scale)


def paged_attention_rows_lse(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                             row_seqs: torch.Tensor, row_visible: torch.Tensor, scale: float,
                             k_scale: float = 1.0, v_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Each query row t over the first row_visible[t] positions of sequence row_seqs[t]'s block table, and its
    lse (kernels.reference.paged_attention_rows_lse): a context-parallel rank's attention over its share of the
    keys, where the positions a row sees are a prefix of the share (stage_worker.context)."""
    impl = _triton_attention() if _use_triton(q) and _has("paged_attention") else _cpu_impl(q)
    return impl.paged_attention_rows_lse(q, k_cache, v_cache, block_tables, row_seqs, row_visible, scale,
                                         k_scale, v_scale)


def merge_attention_states(outputs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """R partial attentions [R, T, H, D] and their lses [R, T, H] merged into the attention over the union of
    their keys, [T, H, D] and its lse [T, H] (kernels.reference.merge_attention_states)."""
    impl = _triton_attention() if _use_triton(outputs) and _has("paged_attention") else _cpu_impl(outputs)
    return impl.merge_attention_states(outputs, lses)


def _triton_attention():
    from kernels import triton_attention

    return triton_attention


def write_latent(latent, k_cache, v_cache, slot_mapping) -> None:
    """Multi-head latent attention's cache write (kernels.mla_reference): each token's latent, halved into the
    k and v tensors of its slot."""
    mla_reference.write_latent(latent, k_cache, v_cache, slot_mapping)


def mla_attention_rows(q, k_cache, v_cache, block_tables, row_seqs, row_visible, scale, kv_lora_rank):
    """Absorbed latent attention of query rows [rows, heads, latent], each over the first row_visible latents of
    its sequence: (weighted c_kv [rows, heads, kv_lora_rank], lse [rows, heads] fp32): Triton on CUDA, the C++
    kernel on fp32 / bf16 CPU tensors (kernels/csrc/mla_decode.cpp), else kernels.mla_reference."""
    if _use_triton(q) and _has("silu_and_mul"):  # triton imports: so does kernels.triton_mla
        from kernels import triton_mla

        return triton_mla.mla_attention_rows(q, k_cache, v_cache, block_tables, row_seqs, row_visible, scale,
                                             kv_lora_rank)
    if _cpu_impl(q) is cpu_ops and k_cache.dtype == q.dtype:  # (an fp8 latent cache is refused at start-up)
        return cpu_ops.mla_attention_rows(q, k_cache, v_cache, block_tables, row_seqs, row_visible, scale,
                                          kv_lora_rank)
    return mla_reference.mla_attention_rows(q, k_cache, v_cache, block_tables, row_seqs, row_visible, scale,
                                            kv_lora_rank)


def rms_norm(x, weight, eps, residual=None):
    impl = _triton() if _use_triton(x) and _has("rms_norm") else _cpu_impl(x)
    return impl.rms_norm(x, weight, eps, residual)


def apply_rotary(q, k, positions, cos_sin_cache):
    impl = _triton() if _use_triton(q) and _has("apply_rotary") else _cpu_impl(q)
    return impl.apply_rotary(q, k, positions, cos_sin_cache)


def rotary_and_cache(qkv, num_heads, num_kv_heads, positions, cos_sin_cache, k_cache, v_cache, slot_mapping,
                     k_scale: float = 1.0, v_scale: float = 1.0):
    """From a fused QKV output [tokens, (num_heads + 2 num_kv_heads) * head_dim]: q rotated [tokens, num_heads,
    head_dim] is returned, k rotated and v are written into their cache slots. apply_rotary + write_kv_cache
    in one C++ call on CPU (a decode step's per-layer overhead); composed of the two elsewhere."""
    if not _use_triton(qkv) and (k_cache.dtype == qkv.dtype or is_fp8(k_cache.dtype)) and _cpu_impl(qkv) is cpu_ops:
        return cpu_ops.rotary_and_cache(qkv, num_heads, num_kv_heads, positions, cos_sin_cache, k_cache, v_cache,
                                        slot_mapping, k_scale, v_scale)
    tokens, d = qkv.shape[0], cos_sin_cache.shape[1]
    q, k, v = qkv.split([num_heads * d, num_kv_heads * d, num_kv_heads * d], -1)
    q, k = apply_rotary(q.view(tokens, num_heads, d), k.view(tokens, num_kv_heads, d), positions, cos_sin_cache)
    write_kv_cache(k, v.view(tokens, num_kv_heads, d), k_cache, v_cache, slot_mapping, k_scale, v_scale)
    return q


def silu_and_mul(x):
    impl = _triton() if _use_triton(x) and _has("silu_and_mul") else _cpu_impl(x)
    return impl.silu_and_mul(x)


# up to this many tokens a step's LoRA products run per token in C++ on CPU; a longer step's gather per adapter
# runs torch's matrix products, which reuse each weight over many tokens (benchmarks/bench_lora.py --kernel)
CPU_LORA_MAX_TOKENS = 128


def add_lora(y, x, lora_a, lora_b, mapping, lora_bt=None) -> None:
    """Multi-LoRA's product into y, in place (stage_worker.lora: `mapping` is the step's LoRAMapping): Triton's
    per-token kernel on CUDA; on CPU the C++ per-token kernel for decode-sized steps (it reads `lora_bt`, B
    transposed); else the torch reference's gather per adapter."""
    if _use_triton(x):
        from kernels import triton_lora

        triton_lora.add_lora(y, x, lora_a, lora_b, mapping.token_slots)
    elif lora_bt is not None and cpu_lora(x, mapping.num_tokens):
        cpu_ops.add_lora(y, x, lora_a, lora_bt, mapping.token_slots)
    else:
        reference.add_lora(y, x, lora_a, lora_b, mapping.groups)


def cpu_lora(x, num_tokens: int) -> bool:
    """Whether a step's LoRA products run in the C++ kernel (kernels/csrc/lora_ops.h)."""
    return num_tokens <= CPU_LORA_MAX_TOKENS and _cpu_impl(x) is cpu_ops


def fused_moe(x, w13, w2, topk_weights, topk_ids, expert_start=0):
    if _use_triton(x) and _has("silu_and_mul"):  # triton imports: so does kernels.triton_moe
        from kernels import triton_moe as impl
    else:
        impl = cpu_ops if _cpu_impl(x, (torch.float32,)) is cpu_ops else moe_reference
    return impl.fused_moe(x, w13, w2, topk_weights, topk_ids, expert_start)


def quant_linear(x, qs, scales, mins, bias=None, int8_activations=False):
    """x W^T + b with W quantised (kernels/quant_reference.py): Triton's weight-only kernel on CUDA, the AVX2
    kernel on CPU where it is built, else the reference."""
    if _use_triton(x) and _has("quant_linear"):
        return _triton().quant_linear(x, qs, scales, mins, bias, int8_activations)
    impl = cpu_ops if _cpu_impl(x) is cpu_ops and quant_built() and cpu_ops.quant_takes(qs) else quant_reference
    return impl.quant_linear(x, qs, scales, mins, bias, int8_activations)


@functools.cache
def quant_built() -> bool:  # once per process: asked by every product
    return cpu_ops.quant_isa() != "none"


build_cos_sin_cache = reference.build_cos_sin_cache
gather_latent = mla_reference.gather_latent  # a sequence's latents, [length, latent]: an index_select on any device
select_experts = moe_reference.select_experts  # softmax and top-k: a few small ops on any device


def _has(name: str) -> bool:
    try:
        return hasattr(_triton(), name)
    except ImportError:
        return False
