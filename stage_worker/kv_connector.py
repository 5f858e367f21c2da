"""The stage's KV connector for disaggregated prefill, over gRPC: a prefill stage streams a held request's
blocks (ReadKV), a decode stage fetches its layers' share of them from the prefill stages that hold them
and writes them into its own blocks (PullKV).

gRPC bytes are what a CPU mesh has, and they cross any network; on GPUs an NCCL connector (device to
device, no host copy) would sit behind the same two calls: it is not built yet (docs/disaggregated-prefill.md).
Every field from the wire is checked before it reaches a tensor: layers, block counts, the chunks' dtype and
sizes, an fp8 chunk's scales (the same for every chunk of a layer; the writing stage converts blocks of another
dtype or other scales into its own cache's: stage_worker.kv_transfer.convert_layers); a source that sends anything
else fails the pull (the decode scheduler's --kv-load-failure-policy then applies: the request fails, or its prompt
is computed). The reads end within the caller's bound (its deadline
less DEADLINES.kv_write_s), so a stalled prefill replica fails the pull then, before anything is written.
A pull reads only from the stages that this stage's own scheduler vouches for (its --kv-peer replicas'
stages, PeerStages): the addresses in a request are checked against them before anything is dialled.
"""
from __future__ import annotations

import asyncio
import math
import time

import grpc
import torch

from kernels.kv_quant import is_fp8
from stagemesh.core import kv_ticket
from stagemesh.core.deadlines import DEADLINES
from stagemesh.core.errors import StagemeshError
from stagemesh.core.service_options import aio_channel
from stagemesh.v1 import scheduler_pb2, scheduler_pb2_grpc, stage_pb2, stage_pb2_grpc

CHUNK_BYTES = 4 * 2**20  # k and v of one chunk together, at most (whole blocks; one block at least)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}
MAX_MESSAGE = 256 * 2**20


async def read_chunks(worker, request: stage_pb2.ReadKVRequest):
    """ReadKV's chunks: the blocks' KV, layer by layer, in chunks of whole blocks; only for a reader with their
    ticket (stagemesh.core.kv_ticket), checked before anything else and refused naming nothing of the stage's."""
    block_ids = list(request.block_ids)
    if not kv_ticket.valid(worker.kv_read_key, request.ticket, request.epoch, block_ids):
        raise NotAPeer("ReadKV refused: the request carries no read ticket for these blocks (a decode replica gets "
                       "it with the request's kv_transfer from the prefill replica's scheduler)")
    kvs = await asyncio.wrap_future(worker.read_kv(request.epoch, block_ids, request.layer_start, request.layer_end))
    scales = worker.runner.kv_scales.values()
    for i, (k, v) in enumerate(kvs):
        per_block = 2 * k[0].numel() * k.element_size()
        step = max(1, CHUNK_BYTES // per_block)
        k_scale, v_scale = scales[request.layer_start - worker.cfg.settings.layer_start + i] if is_fp8(k.dtype) \
            else (0.0, 0.0)
        for first in range(0, len(block_ids), step):
            part_k, part_v = k[first:first + step], v[first:first + step]
            yield stage_pb2.KVBlocksChunk(layer=request.layer_start + i, first_block=first, num_blocks=len(part_k),
                                          dtype=str(k.dtype).removeprefix("torch."), k=_bytes(part_k),
                                          v=_bytes(part_v), k_scale=k_scale, v_scale=v_scale)


class KVReadTimeout(StagemeshError):
    """A pull's reads did not end within its bound (a stalled prefill replica): DEADLINE_EXCEEDED, nothing written."""


class NotAPeer(StagemeshError):
    """A pull names a stage that none of the replicas this stage's scheduler fetches KV from reports, or a read
    comes without the blocks' ticket: PERMISSION_DENIED."""


class PeerStages:
    """The stages this stage may read KV from, as its own scheduler (--scheduler) reports them
    (Scheduler.GetKVPeers); asked again when a pull names one not among those it holds."""

    def __init__(self, scheduler: str):
        self.scheduler = scheduler
        self._known: frozenset[str] = frozenset()

    async def check(self, addresses: list[str]) -> None:
        """NotAPeer unless every address is a known peer stage."""
        unknown = [a for a in addresses if a not in self._known]
        if unknown:
            self._known = await self._ask()
            unknown = [a for a in unknown if a not in self._known]
        if unknown:
            raise NotAPeer(f"PullKV refused: {unknown[0][:200]!r} is not a stage of a prefill replica this stage's "
                           "scheduler fetches KV from (the scheduler's --kv-peer)")

    async def _ask(self) -> frozenset[str]:
        channel = aio_channel(self.scheduler)
        try:
            reply = await scheduler_pb2_grpc.SchedulerStub(channel).GetKVPeers(scheduler_pb2.GetKVPeersRequest(),
                                                                               timeout=DEADLINES.kv_pull_s)
            return frozenset(reply.stage_addresses)
        except grpc.aio.AioRpcError as err:
            raise StagemeshError(f"PullKV: the scheduler at {self.scheduler} did not say which stages KV may be read "
                                 f"from ({err.code().name})") from None
        finally:
            await channel.close()


def read_bound(time_remaining: float | None) -> float:
    """How long a pull may read: its caller's deadline less the time kept for the write (the decode scheduler
    sets the deadline to its --kv-load-timeout plus DEADLINES.kv_write_s); DEADLINES.kv_pull_s without one."""
    if time_remaining is None:
        return DEADLINES.kv_pull_s
    return max(time_remaining - DEADLINES.kv_write_s, 0.05)


async def pull(worker, request: stage_pb2.PullKVRequest, peers: PeerStages,
               bound_s: float | None = None) -> stage_pb2.PullKVResponse:
    """Fetch the stage's layers of the source blocks from the sources and write them into block_ids; the
    fetching (the peers' check and the reads) ends within bound_s or fails, before anything is written."""
    start = time.perf_counter()
    bound = DEADLINES.kv_pull_s if bound_s is None else bound_s
    try:
        layers, scales = await asyncio.wait_for(_fetch(worker, request, peers), bound)
    except TimeoutError:
        raise KVReadTimeout(f"the prefill replica's stages did not send the KV within {bound:.1f}s "
                            "(--kv-load-timeout)") from None
    s = worker.cfg.settings
    kvs = [(layers[layer][0], layers[layer][1]) for layer in range(s.layer_start, s.layer_end)]
    fp8 = [layer in scales for layer in range(s.layer_start, s.layer_end)]
    if any(fp8) and not all(fp8):
        raise StagemeshError("the prefill replica's stages sent some layers' KV in fp8 and others not")
    layer_scales = [scales[layer] for layer in range(s.layer_start, s.layer_end)] if all(fp8) else None
    await asyncio.wrap_future(worker.write_kv(request.epoch, list(request.block_ids), kvs, layer_scales))
    size = sum(k.numel() * k.element_size() * 2 for k, _ in kvs)
    return stage_pb2.PullKVResponse(bytes=size, seconds=time.perf_counter() - start)


async def _fetch(worker, request: stage_pb2.PullKVRequest, peers: PeerStages
                 ) -> tuple[dict[int, list[torch.Tensor]], dict[int, tuple[float, float]]]:
    """The stage's layers of the source blocks, read from the sources (every field checked): layer -> [k, v], and
    the fp8 layers' scales, layer -> (k_scale, v_scale)."""
    await peers.check([src.address for src in request.sources])  # before anything else: nothing dialled otherwise
    s = worker.cfg.settings
    n = len(request.block_ids)
    if n == 0 or n != len(request.source_block_ids):
        raise StagemeshError(f"{n} destination blocks for {len(request.source_block_ids)} source blocks")
    if request.source_block_size != s.block_size:
        raise StagemeshError(f"the prefill replica's blocks hold {request.source_block_size} tokens, this stage's "
                             f"{s.block_size}")
    cache = worker.runner.kv_caches[0][0] if worker.runner.kv_caches else None
    if cache is None or request.epoch != worker.epoch:
        raise StagemeshError(f"KV pulled into epoch {request.epoch}, which is not the stage's")
    # whole blocks as every source sends them (stage_worker.kv_transfer), whatever either side's DCP size
    shape = (worker.runner.block_size, worker.runner.config.num_key_value_heads, cache.shape[3])
    plan = _sources_for(list(request.sources), s.layer_start, s.layer_end)
    layers: dict[int, list[torch.Tensor]] = {}
    scales: dict[int, tuple[float, float]] = {}
    results = await asyncio.gather(*(_read(source, a, b, request, shape) for source, a, b in plan))
    for part, part_scales in results:
        layers.update(part)
        scales.update(part_scales)
    return layers, scales


def _sources_for(sources: list[stage_pb2.KVSource], start: int, end: int) -> list[tuple[str, int, int]]:
    """(address, first layer, end layer) to read from each source overlapping [start, end); they must cover it."""
    plan, covered = [], start
    for src in sorted(sources, key=lambda x: x.layer_start):
        a, b = max(src.layer_start, covered), min(src.layer_end, end)
        if a < b:
            if a != covered:
                break
            plan.append((src.address, a, b))
            covered = b
    if covered != end:
        raise StagemeshError(f"the prefill replica's stages do not hold layers {covered}:{end}")
    return plan


async def _read(address: str, first: int, end: int, request, shape
                ) -> tuple[dict[int, list[torch.Tensor]], dict[int, tuple[float, float]]]:
    """Layers [first, end) of the source blocks from one prefill stage: layer -> [k, v], and layer -> (k_scale,
    v_scale) of those sent in fp8."""
    n = len(request.source_block_ids)
    out: dict[int, list[torch.Tensor]] = {}
    scales: dict[int, tuple[float, float]] = {}
    filled: dict[int, int] = {}
    channel = aio_channel(address, [("grpc.max_receive_message_length", MAX_MESSAGE)])
    try:
        call = stage_pb2_grpc.StageStub(channel).ReadKV(stage_pb2.ReadKVRequest(
            epoch=request.source_epoch, block_ids=request.source_block_ids, layer_start=first, layer_end=end,
            ticket=request.source_ticket), timeout=DEADLINES.kv_pull_s)
        async for chunk in call:
            dtype = DTYPES.get(chunk.dtype)
            if dtype is None or not first <= chunk.layer < end or chunk.num_blocks < 1 or \
                    not 0 <= chunk.first_block <= n - chunk.num_blocks:
                raise StagemeshError(f"{address} sent a KV chunk outside what was asked (layer {chunk.layer}, "
                                     f"blocks {chunk.first_block}+{chunk.num_blocks}, {chunk.dtype!r})")
            _check_scales(address, chunk, dtype, scales)
            kv = out.setdefault(chunk.layer, [torch.empty((n, *shape), dtype=dtype) for _ in range(2)])
            for tensor, raw in zip(kv, (chunk.k, chunk.v)):
                part = tensor[chunk.first_block:chunk.first_block + chunk.num_blocks]
                if tensor.dtype != dtype or len(raw) != part.numel() * part.element_size():
                    raise StagemeshError(f"{address} sent a KV chunk of {len(raw)} bytes for {tuple(part.shape)} "
                                         f"{chunk.dtype} values")
                part.copy_(torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).view(part.shape))
            filled[chunk.layer] = filled.get(chunk.layer, 0) + chunk.num_blocks
    except grpc.aio.AioRpcError as err:
        raise StagemeshError(f"reading KV from {address}: {err.code().name}: {err.details()}") from None
    finally:
        await channel.close()
    missing = [layer for layer in range(first, end) if filled.get(layer) != n]
    if missing:
        raise StagemeshError(f"{address} sent no or partial KV for layers {missing}")
    return out, scales


def _check_scales(address: str, chunk, dtype: torch.dtype, scales: dict[int, tuple[float, float]]) -> None:
    """An fp8 chunk's scales are positive and finite, and those of the layer's first chunk; other chunks carry
    none."""
    given = (chunk.k_scale, chunk.v_scale)
    if not is_fp8(dtype):
        if given != (0.0, 0.0):
            raise StagemeshError(f"{address} sent a {chunk.dtype} KV chunk with fp8 scales")
        return
    if not all(math.isfinite(x) and x > 0 for x in given) or scales.setdefault(chunk.layer, given) != given:
        raise StagemeshError(f"{address} sent fp8 KV of layer {chunk.layer} with the scales {given}, not positive "
                             "or not those of the layer's other chunks")


def _bytes(x: torch.Tensor) -> bytes:
    # bf16 and fp8 have no numpy dtype: the raw bytes
    return x.contiguous().view(torch.uint8).numpy().tobytes()
