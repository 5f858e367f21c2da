"""A stage's KV blocks read and written whole (every KV head), for disaggregated prefill.

TP rank 0 speaks for the stage: on a read its TP ranks gather their KV heads to it, on a write it
broadcasts every head and each rank keeps its own, so the prefill and decode sides may shard the KV
heads differently (other TP sizes). Under decode context parallelism (TPGroup.cp_size D > 1) a rank holds
only its share of each block's tokens (stage_worker.context): the read gathers every rank's share over the TP
group and reassembles the tokens within each DCP group and the KV heads across the groups (assemble_blocks),
the write keeps on each rank its heads and its token offsets (rank_share). What crosses the wire is always the
canonical whole block, [blocks, block_size, every KV head, head_dim], whatever D on either side.
An fp8 cache's blocks cross as fp8 with their layers' k_scale and v_scale (stage_worker.kv_connector); the writing
stage converts what is not in its own cache's dtype and scales (convert_layers), or, with its scales still to be
calculated (--calculate-kv-scales), takes the source's (or calculates them from these keys and values), and
tells its followers.
Both run on the main thread between steps (stage_worker.main_loop): rank 0 tells its followers with a control
message (stage_worker.control's KV_EXPORT / KV_IMPORT, the block ids and layers as int64s) and they take part in
the same collectives.
"""
from __future__ import annotations

import logging

import torch

from kernels.kv_quant import as_bytes, is_fp8, requantize
from stage_worker.control import KV_EXPORT
from stage_worker.kv_scales import K_SCALE_CONSTANT, V_SCALE_CONSTANT, as_f32
from stage_worker.parallel import HeadShard

log = logging.getLogger("stagemesh.stage")


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
        out.append((_whole(runner, k.index_select(0, ids)).cpu(), _whole(runner, v.index_select(0, ids)).cpu()))
    return out


def import_blocks(runner, block_ids: list[int], layers: range, kvs: list[tuple[torch.Tensor, torch.Tensor]] | None,
                  shape: tuple[int, ...], dtype: torch.dtype) -> None:
    """Write every KV head of the blocks for each local layer (rank 0 gives kvs, already in the cache's dtype and
    scales: convert_layers; its followers None and receive them), each rank keeping its own heads and, under DCP,
    its own token offsets. `shape`: [blocks, block_size (the scheduler's), every KV head, head_dim]. An fp8
    cache's scales are rank 0's, sent first (a follower whose scales were still to be calculated takes them)."""
    ids = torch.tensor(block_ids, dtype=torch.long, device=runner.device)
    shard = HeadShard.for_rank(runner.config, runner.tp)
    if is_fp8(dtype) and runner.tp.size > 1:
        scales = torch.tensor(runner.kv_scales.values(), dtype=torch.float32, device=runner.device)
        runner.kv_scales.adopt(runner.tp.broadcast(scales).tolist(), "TP rank 0's KV transfer")
    for i, layer in enumerate(layers):
        for j, cache in enumerate(runner.kv_caches[layer]):
            full = (kvs[i][j].to(device=runner.device, dtype=dtype) if kvs is not None
                    else torch.empty(shape, dtype=dtype, device=runner.device))
            if runner.tp.size > 1:
                runner.tp.broadcast(as_bytes(full))
            share = rank_share(full, runner.tp.cp_size, runner.tp.cp_rank, shard.kv_start, shard.num_kv_heads)
            as_bytes(cache).index_copy_(0, ids, as_bytes(share.to(cache.dtype)))


def convert_layers(runner, kvs: list[tuple[torch.Tensor, torch.Tensor]],
                   scales: list[tuple[float, float]] | None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every layer of this stage's blocks as another replica sent them (`scales`: theirs, for an fp8 cache; None
    for a cache of the model's dtype) in this stage's cache dtype and scales, on rank 0. Scales still to be
    calculated here are the source's, or those of these keys and values (as the first forward would)."""
    dtype = runner.kv_cache_dtype
    source = kvs[0][0].dtype if kvs else dtype
    scales = None if scales is None else [(as_f32(k), as_f32(v)) for k, v in scales]  # (as the kernels use them)
    if is_fp8(dtype) and runner.kv_scales.pending:
        runner.kv_scales.adopt(scales or _calculated(kvs), "the KV a prefill replica sent")
    now = runner.kv_scales.values()
    if source != dtype or (scales is not None and scales != now):
        log.info("KV transfer: the blocks came as %s%s; this stage's cache is %s%s: converted", source,
                 " (their scales)" if scales is not None else "", dtype,
                 " (its scales)" if is_fp8(dtype) else "")
    def convert(i: int, j: int, x: torch.Tensor) -> torch.Tensor:
        return requantize(x, scales[i][j] if scales else 1.0, dtype, now[i][j])
    return [(convert(i, 0, k), convert(i, 1, v)) for i, (k, v) in enumerate(kvs)]


def _calculated(kvs: list[tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[float, float]]:
    """--calculate-kv-scales' scales of whole blocks of every KV head (stage_worker.kv_scales)."""
    def of(x: torch.Tensor, constant: float) -> float:
        top = float(x.float().abs().max()) if x.numel() else 0.0
        return as_f32(top / constant) if top > 0 else 1.0
    return [(of(k, K_SCALE_CONSTANT), of(v, V_SCALE_CONSTANT)) for k, v in kvs]


def follow(runner, kind: int, payload: bytes) -> None:
    """A follower's part of rank 0's export or import."""
    block_ids, layers = decode(payload)
    if kind == KV_EXPORT:
        export_blocks(runner, block_ids, layers)
    else:
        k = runner.kv_caches[0][0]
        shape = (len(block_ids), runner.block_size, runner.config.num_key_value_heads, k.shape[3])
        import_blocks(runner, block_ids, layers, None, shape, k.dtype)


def assemble_blocks(parts: torch.Tensor, dcp_size: int, num_kv_heads: int) -> torch.Tensor:
    """Every TP rank's share of n blocks, [T, n, b, local KV heads, head_dim] in TP rank order, -> the whole
    blocks, [n, b * dcp_size, num_kv_heads, head_dim]. Rank r = g * dcp_size + c holds offsets [c * b, (c + 1) * b)
    of each block (stage_worker.context) and the KV heads of its DCP group g (HeadShard.for_rank): split over
    the T / dcp_size groups in order, or, where the groups outnumber the KV heads, head i replicated on groups
    [i * r, (i + 1) * r), r = groups / num_kv_heads (one copy of each kept)."""
    size, n, b, heads, head_dim = parts.shape
    groups = size // dcp_size
    # tokens within each group, in DCP rank order: [groups, n, block_size, heads, head_dim]
    tokens = parts.reshape(groups, dcp_size, n, b, heads, head_dim).permute(0, 2, 1, 3, 4, 5)
    tokens = tokens.reshape(groups, n, dcp_size * b, heads, head_dim)
    if groups > num_kv_heads:
        tokens = tokens[::groups // num_kv_heads]
    # heads across groups, group-major
    return tokens.permute(1, 2, 0, 3, 4).reshape(n, dcp_size * b, -1, head_dim)


def rank_share(full: torch.Tensor, dcp_size: int, dcp_rank: int, kv_start: int, num_kv_heads: int) -> torch.Tensor:
    """What one rank keeps of whole blocks [n, block_size, every KV head, head_dim]: its KV heads [kv_start,
    kv_start + num_kv_heads) and its DCP rank's token offsets, [n, block_size / dcp_size, num_kv_heads, head_dim]
    (a view)."""
    b = full.shape[1] // dcp_size
    return full[:, dcp_rank * b:(dcp_rank + 1) * b, kv_start:kv_start + num_kv_heads]


def _whole(runner, x: torch.Tensor) -> torch.Tensor:
    """[n, kv_block_size, local KV heads, head_dim] of every rank -> [n, block_size, every KV head, head_dim]: every
    rank's share gathered over the TP group and reassembled (assemble_blocks; DCP size 1: the heads side by side)."""
    tp = runner.tp
    if tp.size == 1:
        return x
    # float32 whatever the cache's dtype (exact for bf16 / fp16 / fp8)
    parts = tp.all_gather(x.float())
    return assemble_blocks(parts, tp.cp_size, runner.config.num_key_value_heads).to(x.dtype)
