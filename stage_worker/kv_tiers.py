"""A TP rank's KV tiers below its paged KV cache (docs/kv-tiers.md): a pool of host-memory slots and, optionally,
the disk tier (stage_worker.kv_disk). The scheduler decides every move; this executes them.

A block here is every KV tensor of one cache block on this rank: k and v of each of the stage's layers (this
rank's KV heads), then a draft model's (on the last stage's rank 0). store() copies device blocks into host slots
(and queues disk writes); a load is split so that files are read off the step loop (read, on any thread) and only
the copy into the cache runs between steps (ready, then fill). Nothing but verified KV of the asked hash is ever
written into a block.

An fp8 cache (--kv-cache-dtype fp8) is stored as it is, fp8, and with it the layers' k_scale and v_scale it was
written with (one more tensor of the block, [layers, 2] fp32): a block filled back under other scales (a disk
tier written by an earlier run of --calculate-kv-scales) is requantised to this stage's, and a stage whose
scales are still to be calculated takes them from the first block it loads (stage_worker.kv_scales).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

from kernels.kv_quant import as_bytes, is_fp8, requantize
from stagemesh.core.errors import StagemeshError
from stage_worker.kv_cache import kv_cache_dtype_name
from stage_worker.kv_disk import VERSION, DiskTier, NamespaceDir, model_fingerprint, nbytes

log = logging.getLogger("stagemesh.stage")
HOST_MEMORY_MARGIN = 2**30  # kept free beside a host tier (and a tenth of what is available)


def block_layout(runner) -> list[tuple[str, tuple[int, ...]]]:
    """(dtype, shape) of each tensor of one block on this rank, in the order a block is stored: k and v of each
    layer, then an fp8 cache's scales."""
    out: list[tuple[str, tuple[int, ...]]] = []
    for r in (runner, *([runner.drafter.runner] if runner.drafter is not None else [])):
        dtype = str(r.kv_cache_dtype).removeprefix("torch.")
        shape = (r.kv_block_size, r.num_kv_heads, r.config.head_dim)
        out += [(dtype, shape)] * (2 * len(r.model.layers))
    if is_fp8(runner.kv_cache_dtype):  # (a draft model refuses an fp8 cache: stage_worker.runner)
        out.append(("float32", (len(runner.model.layers), 2)))
    return out


def kv_namespace(runner, tp_size: int) -> dict:
    """What makes a stage's KV bytes valid: the disk tier's namespace is its digest (stage_worker.kv_disk)."""
    cfg, m = runner.config, runner.model
    draft_model = runner.drafter.runner.model_dir if runner.drafter is not None else None
    return {"format": VERSION, "model": model_fingerprint(runner.model_dir, runner.gguf_file),
            "dtype": str(runner.dtype).removeprefix("torch."),
            "block_size": runner.block_size, "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim,
            "layers": [m.layer_start, m.layer_end], "tp_size": tp_size, "quantization": runner.quantization,
            "draft_model": model_fingerprint(draft_model) if draft_model is not None else None,
            # (only for an fp8 cache: the namespaces of the caches in the model's dtype stay theirs)
            **({"kv_cache_dtype": kv_cache_dtype_name(runner.kv_cache_dtype)} if is_fp8(runner.kv_cache_dtype)
               else {}),
            # (only where it is > 1: the namespaces of the stages made before DCP stay theirs)
            **({"dcp_size": runner.tp.cp_size} if runner.tp.cp_size > 1 else {}),
            # (only where the int8 path runs: its KV differs from the exact path's)
            **({"activations": "int8"} if getattr(runner, "activations", None) == "int8" else {})}


def open_disk_tier(base: str, runner) -> tuple[NamespaceDir, DiskTier]:
    """A one-rank stage's disk tier under `base` (the in-process pipeline's; a stage service's rank 0 opens its
    namespace for every rank: stage_worker.worker)."""
    ns = NamespaceDir(base, kv_namespace(runner, 1), 1, {"model_path": str(runner.model_dir)})
    return ns, DiskTier(ns.path, ns.namespace, 0, block_layout(runner))


def available_host_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os

    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_host_memory(num_blocks: int, bytes_per_block: int, what: str = "this stage") -> None:
    """StagemeshError (naming --kv-offloading-size) when the host tier would not fit the host's memory."""
    need, available = num_blocks * bytes_per_block, available_host_memory()
    margin = max(HOST_MEMORY_MARGIN, available // 10)
    if need > available - margin:
        raise StagemeshError(f"--kv-offloading-size: a host KV tier of {num_blocks:,} blocks needs {need:,} bytes on "
                             f"{what}; the host has {available:,} bytes available and keeps {margin:,} free")


@dataclass
class TierStats:
    stored: int = 0
    loaded_host: int = 0
    loaded_disk: int = 0
    refused: int = 0  # a slot that held another block, a file that failed


class KVTierStore:
    def __init__(self, runner, disk: DiskTier | None = None):
        self.runner, self.disk = runner, disk
        self.layout = block_layout(runner)
        self.pool: list[torch.Tensor] = []  # per tensor of a block: [slots, *its shape], on the host
        self.slot_hashes: list[int | None] = []
        self.stats = TierStats()
        self.pinned = runner.device.type == "cuda"
        self._stream = torch.cuda.Stream(runner.device) if self.pinned else None
        self.scaled = is_fp8(runner.kv_cache_dtype)  # the blocks carry their scales (the layout's last tensor)

    @property
    def num_host_blocks(self) -> int:
        return len(self.slot_hashes)

    @property
    def bytes_per_block(self) -> int:
        """This rank's bytes of one block."""
        return sum(nbytes(dtype, shape) for dtype, shape in self.layout)

    def caches(self) -> list[torch.Tensor]:
        """The cache tensors a block spans, in block_layout's order (an fp8 cache's scales after them are not a
        cache tensor)."""
        out = [t for kv in self.runner.kv_caches for t in kv]
        if self.runner.drafter is not None:
            out += [t for kv in self.runner.drafter.runner.kv_caches for t in kv]
        return out

    def resize(self, num_host_blocks: int) -> None:
        """A host pool of this many slots (kept, with what it holds, when its size is unchanged)."""
        if num_host_blocks == self.num_host_blocks:
            return
        self.pool, self.slot_hashes = [], []
        if num_host_blocks:
            check_host_memory(num_host_blocks, self.bytes_per_block, f"TP rank {self.runner.tp.rank}")
            # uninitialised: a slot is read only once a store recorded its hash
            self.pool = [torch.empty((num_host_blocks, *shape), dtype=getattr(torch, dtype), pin_memory=self.pinned)
                         for dtype, shape in self.layout]
        self.slot_hashes = [None] * num_host_blocks

    # -- store ------------------------------------------------------------------------------
    @torch.inference_mode()
    def store(self, block_ids: list[int], host_slots: list[int], hashes: list[int], to_disk: list[bool],
              disk_evictions: list[int]) -> None:
        """Copy device blocks into host slots (a slot of -1: none, the block goes to disk only), queue the disk
        writes of those with to_disk, delete the evicted files. Arguments are checked by the caller."""
        caches = self.caches()
        scales = [self._scales()] if self.scaled else []
        host = [(b, s, h) for b, s, h in zip(block_ids, host_slots, hashes) if s >= 0]
        if host:
            self._copy(caches, [b for b, _, _ in host], self.pool, [s for _, s, _ in host])
            for _, s, h in host:
                self.slot_hashes[s] = h
                if scales:
                    self.pool[-1][s] = scales[0]
            self.stats.stored += len(host)
        if self.disk is not None:
            for b, s, h, d in zip(block_ids, host_slots, hashes, to_disk):
                if d:
                    parts = [p[s] for p in self.pool] if s >= 0 else [c[b].cpu() for c in caches] + scales
                    payload = torch.cat([p.reshape(-1).view(torch.uint8) for p in parts])
                    self.disk.write(h, payload.numpy().data)
            self.disk.delete(disk_evictions)

    def _copy(self, src: list[torch.Tensor], src_rows: list[int], dst: list[torch.Tensor], dst_rows: list[int]
              ) -> None:
        """dst[t][dst_rows[i]] = src[t][src_rows[i]] for every tensor t, between the cache and the host pool."""
        if self._stream is None:
            i = torch.tensor(src_rows, dtype=torch.long)
            o = torch.tensor(dst_rows, dtype=torch.long)
            for s, d in zip(src, dst):  # (as bytes: torch's CPU index_copy_ takes no float8)
                as_bytes(d).index_copy_(0, o, as_bytes(s).index_select(0, i))
            return
        # CUDA: block by block on a side stream, between the cache and pinned memory; done before returning
        self._stream.wait_stream(torch.cuda.current_stream(self.runner.device))
        with torch.cuda.stream(self._stream):
            for s, d in zip(src, dst):
                for a, b in zip(src_rows, dst_rows):
                    d[b].copy_(s[a], non_blocking=True)
        self._stream.synchronize()

    # -- load -------------------------------------------------------------------------------
    def read(self, host_slots: list[int], hashes: list[int]) -> list[bytearray | memoryview | None]:
        """Off the step loop (any thread): the verified disk payload of each block whose slot is -1; None for the
        others, and for a disk miss."""
        return [self.disk.read(h) if s == -1 and self.disk is not None else None for s, h in zip(host_slots, hashes)]

    def ready(self, host_slots: list[int], hashes: list[int], reads: list) -> list[bool]:
        """Which blocks this rank can fill now: the slot holds the asked hash, or the file was read and verified."""
        return [reads[i] is not None if s == -1 else 0 <= s < self.num_host_blocks and self.slot_hashes[s] == h
                for i, (s, h) in enumerate(zip(host_slots, hashes))]

    @torch.inference_mode()
    def fill(self, block_ids: list[int], host_slots: list[int], reads: list, ok: list[bool]) -> None:
        """Between steps: copy the blocks that are ok (on every rank: see agree) into the cache."""
        caches = self.caches()
        host = [(s, b) for b, s, good in zip(block_ids, host_slots, ok) if good and s >= 0]
        rescaled = [(s, b) for s, b in host if not self._same_scales(self.pool[-1][s])] if self.scaled else []
        host = [x for x in host if x not in rescaled]
        if host:
            self._copy(self.pool, [s for s, _ in host], caches, [b for _, b in host])
        for s, b in rescaled:
            self._put(caches, b, [p[s] for p in self.pool])
        self.stats.loaded_host += len(host) + len(rescaled)
        for b, s, payload, good in zip(block_ids, host_slots, reads, ok):
            if good and s == -1:
                self._put(caches, b, self._parts(payload))
                self.stats.loaded_disk += 1
        self.stats.refused += ok.count(False)

    def _parts(self, payload) -> list[torch.Tensor]:
        """A disk payload's tensors, in the layout's order."""
        out, offset = [], 0
        for dtype, shape in self.layout:
            n = nbytes(dtype, shape)
            raw = torch.frombuffer(payload, dtype=torch.uint8, offset=offset, count=n)
            out.append(raw.view(getattr(torch, dtype)).view(shape))
            offset += n
        return out

    def _put(self, caches: list[torch.Tensor], block: int, parts: list[torch.Tensor]) -> None:
        """One block's tensors into the cache; an fp8 block's requantised where its scales are not this stage's."""
        if not self.scaled:
            for cache, part in zip(caches, parts):
                cache[block].copy_(part)
            return
        stored = parts[-1].tolist()  # [layers][k, v]
        self.runner.kv_scales.adopt(stored, "a block of the KV tiers")
        now = self.runner.kv_scales.values()
        for t, (cache, part) in enumerate(zip(caches, parts)):
            layer, kind = divmod(t, 2)
            cache[block].copy_(requantize(part, stored[layer][kind], cache.dtype, now[layer][kind]))

    def _scales(self) -> torch.Tensor:
        return torch.tensor(self.runner.kv_scales.values(), dtype=torch.float32)

    def _same_scales(self, stored: torch.Tensor) -> bool:
        return not self.runner.kv_scales.pending and bool(torch.equal(stored, self._scales()))

    def load(self, block_ids: list[int], host_slots: list[int], hashes: list[int]) -> list[bool]:
        """read, ready and fill at once (one rank, no TP group: the in-process pipeline)."""
        reads = self.read(host_slots, hashes)
        ok = self.ready(host_slots, hashes, reads)
        self.fill(block_ids, host_slots, reads, ok)
        return ok

    def disk_hashes(self) -> list[int]:
        return self.disk.hashes() if self.disk is not None else []

    def close(self) -> None:
        if self.disk is not None:
            self.disk.close()


def agree(tp, ok: list[bool], device: torch.device) -> list[bool]:
    """What every rank of the TP group can fill (MIN over the group of each rank's flags)."""
    if tp.size == 1 or not ok:
        return ok
    flags = torch.tensor([int(x) for x in ok], dtype=torch.int32, device=device)
    dist.all_reduce(flags, op=dist.ReduceOp.MIN, group=tp.group)
    return [bool(x) for x in flags.tolist()]
