"""An fp8 KV cache's numbers (--kv-cache-dtype fp8, as vLLM's): the reference every kernel is tested against.

A key or value x of a layer is stored as x / scale in float8_e4m3fn (fp8, fp8_e4m3) or float8_e5m2 (fp8_e5m2),
saturated at the format's largest finite value (448, 57344) and rounded to nearest even, and read back as
stored * scale; the scale is the layer's per-tensor k_scale (keys) or v_scale (values). A cache of any other
dtype holds the values as they are and ignores the scales (vLLM's "auto" keeps them at 1.0).

Several torch ops have no CPU kernel for float8 (index_copy_, masked_fill): copies into an fp8 cache go
through its uint8 view (as_bytes).
"""
from __future__ import annotations

import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def quantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """x as an fp8 cache of `dtype` stores it; x converted as it is for any other dtype."""
    if not is_fp8(dtype):
        return x.to(dtype)
    top = torch.finfo(dtype).max
    return (x.float() / scale).clamp(-top, top).to(dtype)


def dequantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """What an element of cache x reads as, in `dtype` (fp32 arithmetic: stored * scale, then rounded once)."""
    if not is_fp8(x.dtype):
        return x.to(dtype)
    return (x.float() * scale).to(dtype)


def as_bytes(x: torch.Tensor) -> torch.Tensor:
    """An fp8 tensor's uint8 view (the same storage), for the copies torch has no float8 kernel of; others as
    they are."""
    return x.view(torch.uint8) if is_fp8(x.dtype) else x


def requantize(x: torch.Tensor, scale: float, dtype: torch.dtype, new_scale: float) -> torch.Tensor:
    """Cache elements x (read with `scale`) as a cache of `dtype` with `new_scale` holds them: an fp8 block moved
    to a cache of another dtype or scale (KV transfer, a disk tier written by an earlier run)."""
    if x.dtype == dtype and (not is_fp8(dtype) or scale == new_scale):
        return x
    return quantize(dequantize(x, scale, torch.float32), new_scale, dtype)
