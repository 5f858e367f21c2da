"""The paged KV cache of a stage: per layer, k and v of [num_blocks, block_size, kv_heads, head_dim]."""
from __future__ import annotations

import torch

from stagemesh.core.errors import StagemeshError


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
                      dtype: torch.dtype, device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(num_layers)]
