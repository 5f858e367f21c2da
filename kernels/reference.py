"""Torch reference implementations of every kernel: the CPU path and the oracle
the Triton kernels are tested against. Signatures are the kernel API that the
model calls through kernels.dispatch. k_scale / v_scale: an fp8 cache's per-tensor scales
(kernels.kv_quant); a cache of another dtype ignores them.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kernels.kv_quant import as_bytes, dequantize, quantize
from stagemesh.core.errors import StagemeshError


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Write this step's keys and values into the paged cache, in place (quantised into an fp8 one)."""
    num_blocks, block_size, heads, dim = k_cache.shape
    for x, cache, s in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        as_bytes(cache).view(num_blocks * block_size, heads, dim).index_copy_(
            0, slot_mapping, as_bytes(quantize(x, s, cache.dtype)))


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    context_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float,
                    decode=None, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """Causal attention of a mixed batch (prefill chunks and decode tokens) over the paged cache.

    Decode rows (query length 1) run as one batch through `decode` (this module's torch
    version unless a kernel is given), prefill chunks one sequence at a time."""
    plan = step_memo("attention", (block_tables, context_lens, query_start_loc),
                     lambda: AttentionPlan(context_lens, query_start_loc))
    decode = decode or _decode
    scales = (k_scale, v_scale)
    if plan.decode_rows is None:
        return decode(q, k_cache, v_cache, block_tables, plan, scale, *scales)
    out = torch.empty_like(q)
    if plan.decode_rows.numel():
        out[plan.decode_rows] = decode(q[plan.decode_rows], k_cache, v_cache, block_tables, plan, scale, *scales)
    for seq, lo, hi, context_len in plan.prefills:
        out[lo:hi] = _one_sequence(q[lo:hi], k_cache, v_cache, block_tables[seq], context_len, scale, *scales)
    return out


class AttentionPlan:
    """One step's split of the batch: decode rows (batched) and prefill chunks (one by one).

    decode_rows is None when every row decodes (row i is sequence i); decode_seqs and
    decode_lens give each decode row's sequence and context length."""

    def __init__(self, context_lens: torch.Tensor, query_start_loc: torch.Tensor):
        num_seqs, device = context_lens.shape[0], context_lens.device
        self.prefills: list[tuple[int, int, int, int]] = []  # (sequence, first row, end row, context length)
        self.decode_rows = None
        self._layout: _GatherLayout | None = None
        if int(query_start_loc[-1]) == num_seqs:  # every query length is 1
            self.decode_seqs, self.decode_lens = torch.arange(num_seqs, device=device), context_lens
            return
        starts, lens = query_start_loc.tolist(), context_lens.tolist()
        seqs, rows = [], []
        for s in range(num_seqs):
            lo, hi = starts[s], starts[s + 1]
            if hi - lo == 1:
                seqs.append(s)
                rows.append(lo)
            elif hi > lo:
                self.prefills.append((s, lo, hi, lens[s]))
        self.decode_rows = torch.tensor(rows, dtype=torch.int64, device=device)
        self.decode_seqs = torch.tensor(seqs, dtype=torch.int64, device=device)
        self.decode_lens = context_lens[self.decode_seqs]

    def gather_layout(self, block_tables: torch.Tensor, cache_shape: torch.Size) -> "_GatherLayout":
        if self._layout is None:
            self._layout = _GatherLayout(block_tables[self.decode_seqs], self.decode_lens, cache_shape)
        return self._layout


class _GatherLayout:
    """Where the decode rows find their keys: one row index per (sequence, KV head, position)
    into the cache viewed as [slots * kv_heads, head_dim], so that one index_select gathers
    each head's keys contiguously; positions past a sequence's length are masked."""

    def __init__(self, block_tables: torch.Tensor, context_lens: torch.Tensor, cache_shape: torch.Size):
        _, block_size, kv_heads, _ = cache_shape
        device = context_lens.device
        self.max_len = max_len = int(context_lens.max())
        pos = torch.arange(max_len, device=device)
        slots = block_tables[:, pos // block_size].long() * block_size + pos % block_size  # [seqs, L]
        heads = torch.arange(kv_heads, device=device)
        self.rows = (slots[:, None, :] * kv_heads + heads[None, :, None]).reshape(-1)  # [seqs * kv_heads * L]
        self.past_end = None  # [seqs, 1, 1, L]: positions past each sequence's end
        if int(context_lens.min()) != max_len:
            self.past_end = (pos[None, :] >= context_lens[:, None].long())[:, None, None]


def _decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
            plan: AttentionPlan, scale: float, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    seqs, heads, dim = q.shape
    kv_heads = k_cache.shape[2]
    layout = plan.gather_layout(block_tables, k_cache.shape)

    def gather(cache, cache_scale):  # [seqs, kv_heads, L, dim], contiguous
        rows = cache.view(-1, dim).index_select(0, layout.rows).view(seqs, kv_heads, layout.max_len, dim)
        return dequantize(rows, cache_scale, q.dtype)

    # the query heads that share a KV head form the rows of one small matrix product
    scores = torch.matmul(q.view(seqs, kv_heads, heads // kv_heads, dim) * scale,
                          gather(k_cache, k_scale).transpose(-1, -2))
    values = gather(v_cache, v_scale)
    if layout.past_end is not None:
        # slots past a sequence's end hold whatever another sequence left there, NaN included: their
        # scores are replaced (not added to) and their values zeroed, so nothing of them reaches this row
        scores.masked_fill_(layout.past_end, float("-inf"))
        values.masked_fill_(layout.past_end.transpose(-1, -2), 0.0)
    return torch.matmul(scores.softmax(-1), values).view(seqs, heads, dim)


def _gather(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    block_size = cache.shape[1]
    blocks = block_table[: math.ceil(length / block_size)].long()
    return cache[blocks].flatten(0, 1)[:length]  # [length, kv_heads, dim]


def _one_sequence(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                  context_len: int, scale: float, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    q_len = q.shape[0]
    k = _gather(k_cache, block_table, context_len).transpose(0, 1)  # [kv_heads, L, d]
    v = _gather(v_cache, block_table, context_len).transpose(0, 1)
    # query i sits at position context_len - q_len + i and sees keys <= its position
    offset = context_len - q_len
    mask = None
    if q_len > 1:
        rows = torch.arange(q_len, device=q.device)[:, None] + offset
        mask = torch.arange(context_len, device=q.device)[None, :] <= rows
    # 4-d (a batch of one): torch's CPU flash kernel takes it, 3-d inputs fall back to the slower math path
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], dequantize(k, k_scale, q.dtype)[None],
                                         dequantize(v, v_scale, q.dtype)[None], attn_mask=mask, scale=scale,
                                         enable_gqa=True)
    return out[0].transpose(0, 1)


def paged_attention_lse(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                        context_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float,
                        k_scale: float = 1.0, v_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """paged_attention's rows (decode tokens and prefill chunks, causal as there) and beside the output the
    log-sum-exp of each (query row, query head)'s scaled scores, [tokens, heads] fp32 (natural log): what
    context parallelism merges partial results by (merge_attention_states). Computed in fp32, one sequence at
    a time: the oracle of the kernels' lse, not a fast path. A sequence of no positions (a context-parallel
    rank that holds none of it) gives output 0 and lse -inf."""
    out = torch.zeros_like(q)
    lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float32, device=q.device)
    starts, lens = query_start_loc.tolist(), context_lens.tolist()
    for seq in range(len(lens)):
        lo, hi, context_len = starts[seq], starts[seq + 1], lens[seq]
        if hi == lo or context_len == 0:
            continue
        k = dequantize(_gather(k_cache, block_tables[seq], context_len), k_scale, torch.float32)
        v = dequantize(_gather(v_cache, block_tables[seq], context_len), v_scale, torch.float32)
        # query i sits at position context_len - q_len + i and sees keys <= its position
        positions = torch.arange(context_len, device=q.device)
        out[lo:hi], lse[lo:hi] = attention_lse(q[lo:hi], k, v, positions[context_len - (hi - lo):], positions, scale)
    return out, lse


def paged_attention_rows_lse(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                             row_seqs: torch.Tensor, row_visible: torch.Tensor, scale: float,
                             k_scale: float = 1.0, v_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Each query row t over the first row_visible[t] positions of sequence row_seqs[t]'s block table, with its
    lse (a row of 0 positions: output 0, lse -inf): what a context-parallel rank computes over its share, whose
    positions seen by a row are a prefix of the share (stage_worker.context). Each row as a one-query sequence."""
    rows = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)
    return paged_attention_lse(q, k_cache, v_cache, block_tables.index_select(0, row_seqs.long()), row_visible,
                               rows, scale, k_scale, v_scale)


def attention_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_positions: torch.Tensor,
                  k_positions: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of q [T, H, D] over keys and values [L, KVH, D] (GQA: H a multiple of KVH) at
    explicit positions: query t sees the keys whose position is <= q_positions[t]. Returns the output
    [T, H, D] in q's dtype and the log-sum-exp [T, H] fp32, all arithmetic in fp32. Any subset of a
    sequence's keys may be given (a context-parallel rank's share, a ring-attention round's chunk); a row
    that sees none of them gives output 0 and lse -inf, which merge_attention_states ignores."""
    group = q.shape[1] // k.shape[1]
    keys = k.float().repeat_interleave(group, 1).transpose(0, 1)  # [H, L, D]
    values = v.float().repeat_interleave(group, 1).transpose(0, 1)
    scores = torch.matmul(q.float().transpose(0, 1), keys.transpose(-1, -2)) * scale  # [H, T, L]
    visible = k_positions[None, :] <= q_positions[:, None]  # [T, L]
    scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, -1)  # [H, T]: -inf for a row that sees nothing
    weights = torch.exp(scores - _finite(lse)[..., None])  # all 0 for a row that sees nothing
    out = torch.matmul(weights, values)
    return out.transpose(0, 1).to(q.dtype), lse.transpose(0, 1).contiguous()


def merge_attention_states(outputs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """R partial attentions of the same queries over disjoint sets of keys, merged into the attention over
    their union (flash attention's merge): outputs [R, T, H, D] (any float dtype), lses [R, T, H] fp32.
    With m = max_r lse_r and w_r = exp(lse_r - m): out = sum_r w_r out_r / sum_r w_r, lse = m + log sum_r w_r,
    in fp32; the output is returned in outputs' dtype, the lse in fp32. A partial of lse -inf (no keys)
    contributes nothing, whatever its output holds (NaN included); where every partial is -inf the merged
    output is 0 and its lse -inf (never NaN), as for a row that sees no key."""
    m = _finite(lses.max(0).values)  # [T, H]; 0 where every partial is empty, so that no -inf - -inf is taken
    weights = torch.exp(lses - m)  # [R, T, H]: 0 for an empty partial
    total = weights.sum(0)
    parts = torch.where(weights[..., None] > 0, outputs.float() * weights[..., None], 0.0)
    out = parts.sum(0) / torch.where(total > 0, total, 1.0)[..., None]
    return out.to(outputs.dtype), m + torch.log(total)


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """lse with -inf (no keys) replaced by 0, to subtract from scores without -inf - -inf = NaN."""
    return torch.where(torch.isneginf(lse), 0.0, lse)


# Every layer of a step sees the same metadata tensors: derive what the torch path
# needs from them once per step, not once per layer (the CPU path is overhead-bound).
_step_memo: dict[str, tuple] = {}


def step_memo(name: str, keys: tuple, compute):
    """compute() once for a step's metadata tensors `keys` (the same objects every layer of the step)."""
    hit = _step_memo.get(name)
    if hit is not None and len(hit[0]) == len(keys) and all(a is b for a, b in zip(hit[0], keys)):
        return hit[1]
    value = compute()
    _step_memo[name] = (keys, value)
    return value


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(Fused residual add +) RMSNorm, computed in fp32 as transformers does."""
    if residual is not None:
        x = x + residual
    if x.dtype == torch.float32:  # one fused op, same arithmetic
        return F.rms_norm(x, (x.shape[-1],), weight, eps), x
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype), x


def apply_rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                 cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding in the rotate-half (NeoX / transformers Llama) layout."""
    cos, sin = step_memo("rotary", (positions, cos_sin_cache), lambda: _cos_sin(positions, cos_sin_cache, q.dtype))
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _cos_sin(positions: torch.Tensor, cos_sin_cache: torch.Tensor, dtype: torch.dtype):
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)  # [tokens, dim/2] each
    # rotate_half(x) * sin == roll(x, dim/2) * cat(-sin, sin): the sign lives in the cached sin
    return (torch.cat((cos, cos), dim=-1)[:, None, :].to(dtype), torch.cat((-sin, sin), dim=-1)[:, None, :].to(dtype))


def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), signed_sin)


def build_cos_sin_cache(head_dim: int, max_positions: int, rope_theta: float, rope_scaling: dict | None,
                        dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> torch.Tensor:
    """cat(cos, sin) per position, [max_positions, head_dim], as transformers computes them in fp32."""
    inv_freq = 1.0 / (rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type, attention_factor = (rope_scaling or {}).get("rope_type", "default"), 1.0
    if rope_type == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, rope_scaling or {})
    elif rope_type == "yarn":  # (DeepSeek's with mscale / mscale_all_dim, gpt-oss's)
        inv_freq, attention_factor = _yarn_inv_freq(head_dim, rope_theta, rope_scaling or {})
    elif rope_type == "linear":  # positions divided by the factor (Gemma 3's global layers)
        inv_freq = inv_freq / float((rope_scaling or {})["factor"])
    elif rope_type != "default":
        raise StagemeshError(f"rope scaling {rope_type!r} is not supported (default, linear, llama3 and yarn are)")
    positions = torch.arange(max_positions, dtype=torch.int64).float()
    freqs = positions[:, None] * inv_freq[None, :]
    # (transformers scales cos and sin by YaRN's attention factor, so q and k both carry it)
    return (torch.cat((freqs.cos(), freqs.sin()), dim=-1) * attention_factor).to(dtype=dtype, device=device)


def _yarn_inv_freq(dim: int, base: float, scaling: dict) -> tuple[torch.Tensor, float]:
    """YaRN's frequencies and attention factor, as transformers' _compute_yarn_parameters: low frequencies
    interpolated by `factor`, high ones kept, a linear ramp between the dims of beta_slow and beta_fast turns;
    the factor from mscale / mscale_all_dim where both are given (DeepSeek), else 0.1 ln(factor) + 1."""
    if not scaling.get("factor") or not scaling.get("original_max_position_embeddings"):
        raise StagemeshError("rope scaling yarn needs its factor and original_max_position_embeddings")
    factor, old_len = float(scaling["factor"]), scaling["original_max_position_embeddings"]

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(scaling.get("beta_fast") or 32), correction_dim(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / ((high - low) or 0.001)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_len = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def add_lora(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, groups) -> None:
    """Multi-LoRA's product, in place: y[rows] += (x[rows] A[slot]^T) B[slot]^T for each (slot, rows) of
    `groups` (rows None: every row). The oracle of kernels.triton_lora (stage_worker.lora.LoRAMapping)."""
    for slot, rows in groups:
        xs = x if rows is None else x.index_select(0, rows)
        delta = (xs @ lora_a[slot].T) @ lora_b[slot].T
        if rows is None:
            y += delta
        else:
            y.index_add_(0, rows, delta)
