"""A stage's KV blocks read and written whole (every KV head), for disaggregated prefill.

TP rank 0 speaks for the stage: on a read its TP ranks gather their KV heads to it, on a write it
broadcasts every head and each rank keeps its own, so the prefill and decode sides may shard the KV
heads differently (other TP sizes). Both run on the main thread between steps (stage_worker.main_loop):
rank 0 tells its followers with a control message (stage_worker.control's KV_EXPORT / KV_IMPORT, the block
ids and layers as int64s) and they take part in the same collectives.
"""
from __future__ import annotations

import torch

from stage_worker.control import KV_EXPORT
from stage_worker.parallel import HeadShard


def encode(block_ids: list[int], layers: range) -> bytes:
    return torch.tensor([layers.start, layers.stop, *block_ids], dtype=torch.int64).numpy().tobytes()


def decode(payload: bytes) -> tuple[list[int], range]:
    values = torch.frombuffer(bytearray(payload), dtype=torch.int64).tolist()
    return values[2:], range(values[0], values[1])


def export_blocks(runner, block_ids: list[int], layers: range) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(k, v) of the blocks for each local layer, every KV head, on the CPU. On a TP stage every rank calls it
    (rank 0 after sending KV_EXPORT); only rank 0's result holds the data."""
    ids = torch.tensor(block_ids, dtype=torch.long, device=runner.device)
    out = []
    for layer in layers:
        k, v = runner.kv_caches[layer]
        out.append((_all_heads(runner, k.index_select(0, ids)).cpu(), _all_heads(runner, v.index_select(0, ids)).cpu()))
    return out


def import_blocks(runner, block_ids: list[int], layers: range, kvs: list[tuple[torch.Tensor, torch.Tensor]] | None,
                  shape: tuple[int, ...], dtype: torch.dtype) -> None:
    """Write every KV head of the blocks for each local layer (rank 0 gives kvs, its followers None and receive
    them), each rank keeping its own heads."""
    ids = torch.tensor(block_ids, dtype=torch.long, device=runner.device)
    shard = HeadShard.for_rank(runner.config, runner.tp)
    for i, layer in enumerate(layers):
        for j, cache in enumerate(runner.kv_caches[layer]):
            full = (kvs[i][j].to(device=runner.device, dtype=dtype) if kvs is not None
                    else torch.empty(shape, dtype=dtype, device=runner.device))
            if runner.tp.size > 1:
                runner.tp.broadcast(full)
            cache.index_copy_(0, ids, full[:, :, shard.kv_start:shard.kv_start + shard.num_kv_heads].to(cache.dtype))


def follow(runner, kind: int, payload: bytes) -> None:
    """A follower's part of rank 0's export or import."""
    block_ids, layers = decode(payload)
    if kind == KV_EXPORT:
        export_blocks(runner, block_ids, layers)
    else:
        k = runner.kv_caches[0][0]
        shape = (len(block_ids), k.shape[1], runner.config.num_key_value_heads, k.shape[3])
        import_blocks(runner, block_ids, layers, None, shape, k.dtype)


def _all_heads(runner, x: torch.Tensor) -> torch.Tensor:
    """[n, block_size, local KV heads, head_dim] of every rank -> every KV head, in order."""
    tp, kv = runner.tp, runner.config.num_key_value_heads
    if tp.size == 1:
        return x
    # gathered along the last dim in rank order; float32 whatever the cache's dtype (exact for bf16 / fp16)
    gathered = tp.all_gather_last_dim(x.float().transpose(2, 3).contiguous()).transpose(2, 3)
    if tp.size > kv:  # KV heads replicated: rank r holds head r // (tp / kv)
        gathered = gathered[:, :, ::tp.size // kv]
    return gathered.to(x.dtype)
