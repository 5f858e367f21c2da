"""The torch reference of the quantised linear (kernels/csrc/quant_linear.cpp) and its two layouts.

A weight W [N, K] is quantised in groups of G (a multiple of 32) along K:
- 4-bit: `qs` uint8 [N, K/2], each 32 weights in 16 bytes (byte j: weight j in the low nibble, weight
  j + 16 in the high one: GGUF's Q4_0 / Q4_1 order), w = scale * q + min, `scales` / `mins` fp32 [N, K/G];
- 8-bit: `qs` int8 [N, K], w = scale * q, `mins` None (GGUF Q8_0: G = 32; per-channel int8: G = K); or
  float8_e4m3fn [N, K] with a scale per output channel (--quantization fp8, CUDA).
Every GGUF format stagemesh serves (stage_worker/gguf.py) and the int8 checkpoints it quantises at load
become one of these; the dequantised numbers are exactly gguf's.
"""
from __future__ import annotations

import torch

CHUNK = 32  # weights per decode in the kernels; every group is a multiple of it


def unpack_4bit(qs: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K/2] -> the quants 0..15 as uint8 [N, K], in k order."""
    n, half = qs.shape
    blocks = qs.view(n, half // 16, 16)
    return torch.cat([blocks & 0x0F, blocks >> 4], dim=-1).reshape(n, half * 2)


def pack_4bit(q: torch.Tensor) -> torch.Tensor:
    """The inverse of unpack_4bit: quants 0..15 [N, K] -> uint8 [N, K/2]."""
    n, k = q.shape
    blocks = q.to(torch.uint8).view(n, k // CHUNK, CHUNK)
    return (blocks[..., :16] | (blocks[..., 16:] << 4)).reshape(n, k // 2)


def quants(qs: torch.Tensor) -> torch.Tensor:
    """The integer quants of either layout as float32 [N, K]."""
    return (unpack_4bit(qs) if qs.dtype == torch.uint8 else qs).float()


def dequantize(qs: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None) -> torch.Tensor:
    """fp32 W [N, K], the very numbers gguf's dequantiser gives (q * d exact in fp32, one rounding with m)."""
    q = quants(qs)
    group = q.shape[1] // scales.shape[1]
    w = q * scales.repeat_interleave(group, dim=1)
    return w if mins is None else w + mins.repeat_interleave(group, dim=1)


ACT_BLOCK = 32  # int8 activations: one scale per row and block of 32 of x (llama.cpp's q8), any weight group


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] fp32 -> int8-valued quants [M, K] (float32) and scales [M, K/32]: max|x| / 127 per row
    and block of 32, round half to even (the kernel's rule)."""
    m, k = x.shape
    g = x.view(m, k // ACT_BLOCK, ACT_BLOCK)
    amax = g.abs().amax(-1, keepdim=True)
    # 127 / amax as a true division (`127.0 / tensor` is a reciprocal times 127 in torch, not the kernel's)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    return torch.round(g * inv).view(m, k), (amax / 127.0).squeeze(-1)


def quant_linear(x: torch.Tensor, qs: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
                 bias: torch.Tensor | None = None, int8_activations: bool = False) -> torch.Tensor:
    """x W^T + b in x's dtype; fp32 arithmetic (float64 sums for the int8-activation path's integer dots)."""
    k = x.shape[-1]
    xf = x.reshape(-1, k).float()
    if not int8_activations:
        out = xf @ dequantize(qs, scales, mins).T
    else:
        group, blocks = k // scales.shape[1], k // ACT_BLOCK
        xq, xd = quantize_activations(xf)
        q = quants(qs)
        m, n, groups = xf.shape[0], q.shape[0], scales.shape[1]
        # integer dot of each (row, weight row, block of 32), then the two scales
        dots = torch.einsum("mbi,nbi->mnb", xq.double().view(m, blocks, ACT_BLOCK),
                            q.double().view(n, blocks, ACT_BLOCK))
        block_scales = scales.double().repeat_interleave(group // ACT_BLOCK, dim=1)
        out = (dots * xd.double()[:, None, :] * block_scales[None]).sum(-1)
        if mins is not None:  # the mins meet the quantised x's group sums (the kernel's quantize_rows)
            block_sums = (xq.view(m, blocks, ACT_BLOCK).sum(-1) * xd).float()
            sums = block_sums.view(m, groups, group // ACT_BLOCK).sum(-1)
            out = out + sums.double() @ mins.double().T
        out = out.float()
    if bias is not None:
        out = out + bias.float()
    return out.reshape(*x.shape[:-1], -1).to(x.dtype)


def quantize_int8_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W [N, K] -> int8 quants [N, K] and fp32 scales [N, 1] (max|w| / 127 per output channel, round half
    to even), the weights of --quantization w8a16 / w8a8."""
    wf = w.float()
    amax = wf.abs().amax(1, keepdim=True)
    scales = amax / 127.0
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    return torch.round(wf * inv).clamp(-127, 127).to(torch.int8), scales.contiguous()


FP8_MAX = 448.0  # float8_e4m3fn's largest finite value


def quantize_fp8_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W [N, K] -> float8_e4m3fn quants [N, K] and fp32 scales [N, 1] (max|w| / 448 per output channel, torch's
    round-to-nearest-even cast), the weights of --quantization fp8."""
    wf = w.float()
    amax = wf.abs().amax(1, keepdim=True)
    inv = torch.where(amax > 0, torch.full_like(amax, FP8_MAX) / amax, torch.zeros_like(amax))
    q = (wf * inv).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, (amax / FP8_MAX).contiguous()
