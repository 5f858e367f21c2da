"""Triton attention over the paged KV cache: decode and prefill-chunk kernels.

Cache layout: [num_blocks, block_size, num_kv_heads, head_dim]. Both kernels
gather a tile of keys through the block table (several blocks per tile) and
keep an online softmax in fp32. An fp8 cache (kernels.kv_quant) is widened to q's
dtype as it is loaded (exact); its key scale is folded into the scores' scale and
its value scale into the output rows (v_scale), so the loops are any cache's.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels.kv_quant import is_fp8
from stagemesh.core.errors import StagemeshError


@triton.jit
def _decode_kernel(q_ptr, kc_ptr, vc_ptr, bt_ptr, ctx_ptr, out_ptr, lse_ptr, scale, v_scale, stride_qt, stride_qh,
                   stride_cb,
                   stride_cs, stride_ch, stride_bt, stride_ot, stride_oh, stride_lt, GROUP: tl.constexpr,
                   GROUP_PAD: tl.constexpr, BS: tl.constexpr, TILE: tl.constexpr, D: tl.constexpr,
                   D_PAD: tl.constexpr, PRECISION: tl.constexpr, HAS_LSE: tl.constexpr):
    s = tl.program_id(0)
    kvh = tl.program_id(1)
    ctx = tl.load(ctx_ptr + s)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, D_PAD)
    dmask = d < D
    heads = kvh * GROUP + g
    q = tl.load(q_ptr + s * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=(g < GROUP)[:, None] & dmask[None, :], other=0.0)
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)
    for start in range(0, ctx, TILE):
        n = start + tl.arange(0, TILE)
        valid = n < ctx
        block = tl.load(bt_ptr + s * stride_bt + n // BS, mask=valid, other=0).to(tl.int64)
        offs = block[:, None] * stride_cb + (n % BS)[:, None] * stride_cs + kvh * stride_ch + d[None, :]
        k = tl.load(kc_ptr + offs, mask=valid[:, None] & dmask[None, :], other=0.0)
        v = tl.load(vc_ptr + offs, mask=valid[:, None] & dmask[None, :], other=0.0)
        scores = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION) * scale
        scores = tl.where(valid[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, 1))
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m - m_new)
        l = l * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=PRECISION)
        m = m_new
    if HAS_LSE:  # compiled in only when asked
        tl.store(lse_ptr + s * stride_lt + heads, m + tl.log(l), mask=g < GROUP)
        l = tl.where(l > 0, l, 1.0)  # a sequence of no positions here (a CP rank's empty share): output 0
    out = acc / l[:, None] * v_scale
    tl.store(out_ptr + s * stride_ot + heads[:, None] * stride_oh + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=(g < GROUP)[:, None] & dmask[None, :])


@triton.jit
def _prefill_kernel(q_ptr, kc_ptr, vc_ptr, bt_ptr, ctx_ptr, qsl_ptr, out_ptr, lse_ptr, vis_ptr, scale, v_scale,
                    stride_qt,
                    stride_qh, stride_cb, stride_cs, stride_ch, stride_bt, stride_ot, stride_oh, stride_lt,
                    GROUP: tl.constexpr, BS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    D: tl.constexpr, D_PAD: tl.constexpr, PRECISION: tl.constexpr, HAS_LSE: tl.constexpr,
                    HAS_VISIBLE: tl.constexpr):
    """HAS_VISIBLE: each row sees the first vis[row] positions of the block table (a context-parallel rank's
    share, paged_attention_rows_lse), not those up to its place at the end of the context."""
    s = tl.program_id(0)
    h = tl.program_id(1)
    mblock = tl.program_id(2)
    q_start = tl.load(qsl_ptr + s)
    q_len = tl.load(qsl_ptr + s + 1) - q_start
    if mblock * BLOCK_M < q_len:
        ctx = tl.load(ctx_ptr + s)
        offset = ctx - q_len  # position of the chunk's first token
        kvh = h // GROUP
        rows = mblock * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < q_len
        d = tl.arange(0, D_PAD)
        dmask = d < D
        q = tl.load(q_ptr + (q_start + rows)[:, None] * stride_qt + h * stride_qh + d[None, :],
                    mask=row_ok[:, None] & dmask[None, :], other=0.0)
        if HAS_VISIBLE:
            seen = tl.load(vis_ptr + q_start + rows, mask=row_ok, other=0)  # positions [0, seen) for each row
            last = tl.max(seen)
        else:
            seen = offset + rows + 1  # causal: its own position and those before it
            last = tl.minimum(ctx, offset + (mblock + 1) * BLOCK_M)  # no key past the tile's last query
        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
        for start in range(0, last, BLOCK_N):
            n = start + tl.arange(0, BLOCK_N)
            valid = n < last
            block = tl.load(bt_ptr + s * stride_bt + n // BS, mask=valid, other=0).to(tl.int64)
            offs = block[:, None] * stride_cb + (n % BS)[:, None] * stride_cs + kvh * stride_ch + d[None, :]
            k = tl.load(kc_ptr + offs, mask=valid[:, None] & dmask[None, :], other=0.0)
            v = tl.load(vc_ptr + offs, mask=valid[:, None] & dmask[None, :], other=0.0)
            scores = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION) * scale
            keep = (n[None, :] < seen[:, None]) & valid[None, :]
            scores = tl.where(keep, scores, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, 1))
            if HAS_VISIBLE:  # a row that has seen no position yet (or sees none): its -inf scores weigh 0, not NaN
                m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            else:
                m_use = m_new
            p = tl.exp(scores - m_use[:, None])
            alpha = tl.exp(m - m_use)
            l = l * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=PRECISION)
            m = m_new
        if HAS_LSE:
            tl.store(lse_ptr + (q_start + rows) * stride_lt + h, m + tl.log(l), mask=row_ok)
            l = tl.where(l > 0, l, 1.0)  # a row that sees no position: output 0
        out = acc / l[:, None] * v_scale
        tl.store(out_ptr + (q_start + rows)[:, None] * stride_ot + h * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dmask[None, :])


def _checks(q, k_cache, block_tables, context_lens, query_start_loc) -> tuple[int, int, int]:
    tokens, heads, d = q.shape
    num_blocks, bs, kv_heads, kd = k_cache.shape
    problems = [
        (d % 16 == 0 and 16 <= d <= 256, f"head_dim {d} must be a multiple of 16 up to 256"),
        (kd == d, f"cache head_dim {kd} != query head_dim {d}"),
        (heads % kv_heads == 0, f"{heads} query heads are not a multiple of {kv_heads} KV heads"),
        (bs >= 1 and bs & (bs - 1) == 0, f"block size {bs} must be a power of two"),
        (k_cache.is_contiguous(), "the KV cache must be contiguous"),
        (q.stride(-1) == 1, "q must be contiguous in the last dim"),
        (block_tables.dim() == 2 and block_tables.shape[0] == context_lens.shape[0],
         "one block-table row per sequence"),
        (query_start_loc.shape[0] == context_lens.shape[0] + 1, "query_start_loc needs num_seqs + 1 entries"),
    ]
    for ok, message in problems:
        if not ok:
            raise StagemeshError(f"paged_attention input: {message}")
    return heads // kv_heads, bs, d


def paged_attention(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale, k_scale: float = 1.0,
                    v_scale: float = 1.0):
    return _attention(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, _Scales.of(
        scale, k_cache, k_scale, v_scale), None)


def paged_attention_lse(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                        context_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float,
                        k_scale: float = 1.0, v_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """paged_attention and the log-sum-exp of each row's scaled scores, [tokens, heads] fp32, from the kernels'
    own online softmax (kernels.reference.paged_attention_lse); a sequence of no positions gives output 0
    and lse -inf."""
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
    scales = _Scales.of(scale, k_cache, k_scale, v_scale)
    return _attention(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scales, lse), lse


class _Scales(NamedTuple):
    """The kernels' two scales: the scores' (softmax scale x an fp8 cache's k_scale) and the output rows'."""
    qk: float
    v: float

    @classmethod
    def of(cls, scale: float, k_cache: torch.Tensor, k_scale: float, v_scale: float) -> "_Scales":
        return cls(scale * k_scale, v_scale) if is_fp8(k_cache.dtype) else cls(scale, 1.0)


def _attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
               context_lens: torch.Tensor, query_start_loc: torch.Tensor, scales: _Scales,
               lse: torch.Tensor | None) -> torch.Tensor:
    """Either kernel, storing each row's lse into `lse` when it is given (else the kernels are compiled
    without it)."""
    group, bs, d = _checks(q, k_cache, block_tables, context_lens, query_start_loc)
    num_seqs, kv_heads = context_lens.shape[0], k_cache.shape[2]
    out = torch.empty_like(q)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    lse_args = (out if lse is None else lse,)  # a pointer the kernel never reads without HAS_LSE
    common = (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0), out.stride(0),
              out.stride(1), 0 if lse is None else lse.stride(0))
    if q.shape[0] == num_seqs:  # all decode
        tile = max(16, bs) if q.device.type == "cpu" else max(64, bs)
        _decode_kernel[(num_seqs, kv_heads)](q, k_cache, v_cache, block_tables, context_lens, out, *lse_args,
                                             scales.qk, scales.v, q.stride(0), q.stride(1), *common, GROUP=group,
                                             GROUP_PAD=max(16, triton.next_power_of_2(group)), BS=bs, TILE=tile, D=d,
                                             D_PAD=triton.next_power_of_2(d), PRECISION=precision,
                                             HAS_LSE=lse is not None)
        return out
    _prefill(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, out, lse, None, scales)
    return out


def _prefill(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, out, lse, visible,
             scales: _Scales) -> None:
    group, bs, d = _checks(q, k_cache, block_tables, context_lens, query_start_loc)
    max_q = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    block_m = 16 if max_q <= 16 else 64
    grid = (context_lens.shape[0], q.shape[1], triton.cdiv(max_q, block_m))
    _prefill_kernel[grid](q, k_cache, v_cache, block_tables, context_lens, query_start_loc, out,
                          out if lse is None else lse, out if visible is None else visible, scales.qk, scales.v,
                          q.stride(0),
                          q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
                          out.stride(0), out.stride(1), 0 if lse is None else lse.stride(0), GROUP=group, BS=bs,
                          BLOCK_M=block_m, BLOCK_N=max(16, min(64, bs * 4)), D=d, D_PAD=triton.next_power_of_2(d),
                          PRECISION="ieee" if q.dtype == torch.float32 else "tf32", HAS_LSE=lse is not None,
                          HAS_VISIBLE=visible is not None)


def paged_attention_rows_lse(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                             row_seqs: torch.Tensor, row_visible: torch.Tensor, scale: float,
                             k_scale: float = 1.0, v_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """kernels.reference.paged_attention_rows_lse: the rows cut into runs of one sequence (a prefill chunk's rows
    run together, sharing their key loads, as the prefill kernel's tiles do), each row seeing its own count of
    the run's positions. Where every run is one row (decode), the decode kernel, a row a sequence."""
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
    scales = _Scales.of(scale, k_cache, k_scale, v_scale)
    if q.shape[0] == 0:
        return torch.empty_like(q), lse
    seqs, counts = torch.unique_consecutive(row_seqs.long(), return_counts=True)
    if seqs.shape[0] == q.shape[0]:
        rows = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)
        return _attention(q, k_cache, v_cache, block_tables.index_select(0, seqs), row_visible.to(torch.int32),
                          rows, scales, lse), lse
    starts = torch.zeros(seqs.shape[0] + 1, dtype=torch.int32, device=q.device)
    starts[1:] = torch.cumsum(counts, 0)
    out = torch.empty_like(q)
    # (context_lens, which HAS_VISIBLE leaves unread, only sizes the grid: one program row per run)
    _prefill(q, k_cache, v_cache, block_tables.index_select(0, seqs).contiguous(), counts.to(torch.int32), starts,
             out, lse, row_visible.to(torch.int32).contiguous(), scales)
    return out, lse


@triton.jit
def _merge_kernel(parts_ptr, part_lse_ptr, out_ptr, lse_ptr, R, T, H, D: tl.constexpr, D_PAD: tl.constexpr,
                  BLOCK_H: tl.constexpr):
    """One program per (row, block of heads): the R partials of those heads merged by their lse (contiguous
    [R, T, H, D] outputs and [R, T, H] lses in, [T, H, D] and [T, H] out)."""
    t = tl.program_id(0)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = h < H
    d = tl.arange(0, D_PAD)
    mask = hmask[:, None] & (d < D)[None, :]
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    for r in range(R):
        m = tl.maximum(m, tl.load(part_lse_ptr + (r * T + t) * H + h, mask=hmask, other=float("-inf")))
    m = tl.where(m == float("-inf"), 0.0, m)  # every partial empty: weights 0, no -inf - -inf
    total = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, D_PAD], tl.float32)
    for r in range(R):
        w = tl.exp(tl.load(part_lse_ptr + (r * T + t) * H + h, mask=hmask, other=float("-inf")) - m)
        part = tl.load(parts_ptr + ((r * T + t) * H + h)[:, None] * D + d[None, :], mask=mask, other=0.0)
        acc += tl.where(w[:, None] > 0, part.to(tl.float32) * w[:, None], 0.0)  # an empty partial: nothing, NaN or not
        total += w
    out = acc / tl.where(total > 0, total, 1.0)[:, None]
    tl.store(out_ptr + (t * H + h)[:, None] * D + d[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(lse_ptr + t * H + h, m + tl.log(total), mask=hmask)


def merge_attention_states(outputs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """kernels.reference.merge_attention_states in one kernel: outputs [R, T, H, D], lses [R, T, H] fp32."""
    if outputs.dim() != 4 or lses.shape != outputs.shape[:3] or lses.dtype != torch.float32:
        raise StagemeshError(f"merge_attention_states input: outputs [R, T, H, D] and lses [R, T, H] fp32, "
                             f"not {tuple(outputs.shape)} and {tuple(lses.shape)} {lses.dtype}")
    parts, part_lses = outputs.contiguous(), lses.contiguous()
    r, t, h, d = parts.shape
    out = torch.empty((t, h, d), dtype=parts.dtype, device=parts.device)
    lse = torch.empty((t, h), dtype=torch.float32, device=parts.device)
    block_h = min(16, triton.next_power_of_2(h))
    if t:
        _merge_kernel[(t, triton.cdiv(h, block_h))](parts, part_lses, out, lse, r, t, h, D=d,
                                                    D_PAD=triton.next_power_of_2(d), BLOCK_H=block_h)
    return out, lse
