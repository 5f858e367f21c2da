"""The paged KV cache of a stage: per layer, k and v of [num_blocks, block_size, kv_heads, head_dim], in the
model's dtype or, with --kv-cache-dtype fp8, in float8 (half the bytes of bf16, a quarter of fp32's; the
scales are stage_worker.kv_scales')."""
from __future__ import annotations

import torch

from stagemesh.core import kv_cache_dtype
from stagemesh.core.errors import StagemeshError
from stagemesh.core.model_config import ModelConfig


def resolve_kv_cache_dtype(name: str | None, model_dtype: torch.dtype) -> torch.dtype:
    """The cache's torch dtype for --kv-cache-dtype `name` (auto: the model's; the name refused if unknown)."""
    canonical = kv_cache_dtype.canonical(name)
    if canonical == "auto":
        return model_dtype
    return getattr(torch, kv_cache_dtype.TORCH_NAMES[canonical])


def check_kv_cache_dtype(name: str | None, cfg: ModelConfig) -> None:
    """Refuse, by name, the layouts whose fp8 cache is not built."""
    kv_cache_dtype.check_attention(name, cfg)


def check_kv_cache_device(name: str | None, device: torch.device) -> None:
    """An fp8 cache on CUDA runs the Triton kernels' fp8 conversions, which need compute capability 8.9 (Ada,
    Hopper) or newer: refused by name on an older GPU."""
    if kv_cache_dtype.is_fp8(name) and device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if capability < (8, 9):
            raise StagemeshError(f"--kv-cache-dtype {name} on CUDA needs compute capability 8.9 or newer (the Triton "
                                 f"kernels' fp8 conversions); this GPU has {capability[0]}.{capability[1]}: use "
                                 "--kv-cache-dtype auto")


def kv_cache_dtype_name(dtype: torch.dtype) -> str:
    """What a stage says its cache is (StageDescription.kv_cache_dtype): fp8_e4m3, fp8_e5m2, or auto."""
    for name, torch_name in kv_cache_dtype.TORCH_NAMES.items():
        if dtype == getattr(torch, torch_name):
            return name
    return "auto"


def kv_bytes_per_block(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int,
                       dtype: torch.dtype) -> int:
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * itemsize


def num_kv_blocks_for_budget(budget_bytes: int, bytes_per_block: int) -> int:
    blocks = int(budget_bytes // bytes_per_block)
    if blocks < 1:
        raise StagemeshError(
            f"the KV cache budget of {budget_bytes:,} bytes holds no block of {bytes_per_block:,} bytes; "
            "raise --kv-cache-memory or --gpu-memory-utilization"
        )
    return blocks


def allocate_kv_cache(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                      dtype: torch.dtype, device,
                      slots: list[int] | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's k and v caches. `slots`: each layer's slot (stagemesh.core.kv_groups), layers on one slot
    sharing its tensors (each reads and writes only its own group's blocks); None: a slot per layer."""
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    slots = list(range(num_layers)) if slots is None else slots
    pairs = [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
             for _ in range(max(slots, default=-1) + 1)]
    return [pairs[slot] for slot in slots]
