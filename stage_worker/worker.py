"""A stage's TP rank 0: owns the model slice, the TP followers' processes and the epochs.

Steps go through the stage's step executor (stage_worker.step_executor), which
the gRPC servicer (stage_worker.service) submits them to; this class starts the
followers, joins and leaves epochs, and reads and writes KV blocks between steps, and moves them between the
cache and its host and disk tiers (stage_worker.kv_tiers) as the scheduler says.
"""
from __future__ import annotations

import json
import logging
import os
import subprocess
import itertools
import threading
import uuid
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from stagemesh.core.errors import StagemeshError
from stagemesh.core.lora import LoRAError
from stagemesh.core.speculative import SpeculativeConfig
from stagemesh.core.step import EpochSpec
from stagemesh.core.step_wire import epoch_to_pb
from stage_worker import control, eplb, kv_transfer
from stage_worker import dist as sdist
from stage_worker import kv_tier_ranks
from stage_worker.kv_disk import DiskTier, NamespaceDir
from stage_worker.kv_tiers import KVTierStore, block_layout, check_host_memory, kv_namespace
from stage_worker.draft import make_drafter
from stage_worker.ep_group import EPConfig, EPGroup
from stage_worker.kv_cache import num_kv_blocks_for_budget
from stage_worker.follower import start_message
from stage_worker.follower_start import ForkedFollower, start_follower
from stage_worker.runner import StageRunner
from stage_worker.settings import StageSettings
from stage_worker.step_executor import StepExecutor
from stage_worker.validate import InvalidStep, StepLimits, check_join

log = logging.getLogger("stagemesh.stage")


@dataclass(frozen=True)
class StageConfig:
    settings: StageSettings  # the model slice's, every TP rank's (stage_worker.settings)
    stage_index: int
    handoff: str = "grpc"
    kv_cache_memory: int | None = None  # bytes; None: from gpu_memory_utilization (CUDA) or 512 MiB (CPU)
    gpu_memory_utilization: float = 0.9
    ep: EPConfig | None = None  # experts spread over the data-parallel replicas' stages (stage_worker.ep_group)
    standby: bool = False  # a spare for a served index (see scheduler.rendezvous): KV allocated at start
    speculative: SpeculativeConfig | None = None  # the last stage's draft model (stage_worker.draft)
    kv_offloading_disk_path: str | None = None  #: the disk KV tier's directory (stage_worker.kv_disk)
    forked_followers: list[ForkedFollower] = field(default_factory=list)  # stage_worker.follower_start; []: spawn


MAX_DISK_EVICTIONS = 1 << 16  # per StoreKV call


class StageWorker:
    def __init__(self, cfg: StageConfig):
        if cfg.handoff not in ("nccl", "grpc"):
            raise StagemeshError(f"--handoff {cfg.handoff!r} must be nccl or grpc")
        self.cfg = cfg
        self.ep = EPGroup(cfg.ep, cfg.stage_index) if cfg.ep is not None else None
        self.runner = StageRunner(cfg.settings, ep=self.ep)
        if cfg.speculative is not None:  # before the KV budget is shared out: the draft's blocks count
            s = cfg.settings
            self.runner.attach_drafter(make_drafter(cfg.speculative, self.runner.config, s.model_dir,
                                                    self.runner.device, s.dtype, s.block_size, s.load_format))
        # the disk tier's directory, locked for the stage's life, before the followers use it
        self.disk_dir = None if not cfg.kv_offloading_disk_path else NamespaceDir(
            cfg.kv_offloading_disk_path, kv_namespace(self.runner, cfg.settings.ranks), cfg.settings.ranks,
            {"model_path": str(cfg.settings.model_dir), "stage_index": cfg.stage_index})
        disk = None if self.disk_dir is None else DiskTier(self.disk_dir.path, self.disk_dir.namespace, 0,
                                                           block_layout(self.runner))
        self.tiers = KVTierStore(self.runner, disk)
        self._load_ids = itertools.count()
        self.followers = [self._start_follower(t) for t in range(1, cfg.settings.ranks)]
        for t, proc in enumerate(self.followers, start=1):
            assert proc.stdout is not None  # (started with stdout=PIPE: _start_follower)
            if proc.stdout.readline().strip() != b"ready":
                raise StagemeshError(f"TP follower {t} failed to load its shard (exit code {proc.wait()})")
        # what the followers are to do, all of it (stage_worker.control); None: no followers
        self.control = control.FollowerChannel(self.followers) if self.followers else None
        self.num_kv_blocks = num_kv_blocks_for_budget(self._kv_budget(), self.runner.kv_bytes_per_block)
        self.instance_id = uuid.uuid4().hex  # a restarted stage is another instance to the scheduler
        model = self.runner.config
        self._joining = threading.Lock()  # one join at a time (a second waits for the first to end)
        self.kv_read_key = b""  # the scheduler's, from each join: ReadKV's tickets (none before a join)
        balancer = None if self.runner.eplb is None else eplb.Balancer(
            self.runner.eplb, eplb.balanced_blocks(self.runner.model), cfg.settings.tensor_parallel_size,
            cfg.stage_index)
        # nothing is allowed before a join
        limits = StepLimits(model.vocab_size, model.hidden_size, cfg.settings.block_size,
                            num_kv_groups=self.runner.kv_groups.num_groups)
        self.steps = StepExecutor(self.runner, cfg.stage_index, cfg.handoff, limits, self.control, self.ep,
                                  balancer)

    # -- start-up ---------------------------------------------------------------
    def _start_follower(self, tp_rank: int) -> subprocess.Popen | ForkedFollower:
        disk = (str(self.disk_dir.path), self.disk_dir.namespace) if self.disk_dir is not None else None
        return start_follower(self.cfg.forked_followers, tp_rank, start_message(self.cfg.settings, tp_rank, disk))

    @property
    def kv_bytes_per_block(self) -> int:
        """One block of this stage's layers over every TP rank (the draft model's, on rank 0 only, once)."""
        draft = self.runner.drafter.kv_bytes_per_block if self.runner.drafter is not None else 0
        return (self.runner.kv_bytes_per_block - draft) * self.cfg.settings.ranks + draft

    def disk_block_hashes(self) -> list[int]:
        """The disk tier's blocks every TP rank holds, least recently written first."""
        return self.disk_dir.common_hashes(self.cfg.settings.ranks) if self.disk_dir is not None else []

    def _kv_budget(self) -> int:
        if self.cfg.kv_cache_memory:
            return self.cfg.kv_cache_memory
        if self.runner.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.runner.device)
            used = total - free
            return max(int(total * self.cfg.gpu_memory_utilization) - used, 0)
        return 512 * 2**20

    def free_memory_bytes(self) -> int:
        if self.runner.device.type == "cuda":
            return torch.cuda.mem_get_info(self.runner.device)[0]
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")

    def followers_alive(self) -> bool:
        return all(proc.poll() is None for proc in self.followers)

    @property
    def epoch(self) -> int:
        return self.steps.epoch

    @property
    def limits(self) -> StepLimits:
        return self.steps.limits

    # -- epochs -------------------------------------------------------------------
    def check_join(self, req: EpochSpec) -> None:
        """A JoinPipeline that does not fit this stage is refused before the stage leaves its epoch, and so is
        any join while its expert-parallel group is broken (EPGroupBroken: the stage is on its way out)."""
        if self.ep is not None:
            self.ep.raise_if_broken()
        c = self.cfg
        check_join(req, c.stage_index, c.settings.ranks, self.num_kv_blocks, self.runner.config.max_position_embeddings,
                   self.runner.is_last_stage, c.handoff == "grpc" and not self.runner.is_last_stage)
        if not 0 <= req.num_host_kv_blocks < 2**31:
            raise InvalidStep(f"num_host_kv_blocks {req.num_host_kv_blocks} must be 0 or more")
        if req.num_host_kv_blocks != self.tiers.num_host_blocks:
            check_host_memory(req.num_host_kv_blocks, self.kv_bytes_per_block, f"stage {c.stage_index}'s TP ranks")

    def join(self, req: EpochSpec) -> None:
        """Leave the old epoch (waking anything blocked in it) and join the new one."""
        with self._joining:
            self._join(req)

    def _join(self, req: EpochSpec) -> None:
        self._leave()
        self.kv_read_key = req.kv_read_key  # (ReadKV answers only a reader with a ticket under it)
        if self.control is not None:
            self.control.send(control.JOIN, req.epoch, epoch_to_pb(req).SerializeToString())
        rank = sdist.join_world(req, self.runner.tp, self.runner.device)
        self.steps.loop.call(self.runner.reset, req.num_kv_blocks)
        self.steps.loop.call(self.tiers.resize, req.num_host_kv_blocks)
        self.steps.begin_epoch(req, rank)
        s = self.cfg.settings
        dcp, pcp = s.decode_context_parallel_size, s.prefill_context_parallel_size
        context = f", DCP={dcp}" if dcp > 1 else f", PCP={pcp}" if pcp > 1 else ""
        log.info("joined epoch %d as rank %d of %d (layers %d:%d, TP=%d%s, %s handoff, %d KV blocks)", req.epoch, rank,
                 req.world_size, s.layer_start, s.layer_end, s.tensor_parallel_size, context, self.cfg.handoff,
                 req.num_kv_blocks)

    def _leave(self) -> None:
        epoch = self.steps.epoch
        self.steps.end_epoch()
        if self.control is not None and epoch >= 0:
            try:
                self.control.send(control.LEAVE, epoch)
            except StagemeshError as err:  # a follower gone: the next join says so
                log.warning("could not tell followers to leave: %s", err)
        sdist.leave_world(self.runner.tp)

    # -- KV transfer (disaggregated prefill) -------------------------------------------
    def read_kv(self, epoch: int, block_ids: list[int], layer_start: int, layer_end: int) -> Future:
        """Every KV head of the blocks for model layers [layer_start, layer_end) of this stage: a future of
        [(k, v)] per layer, CPU tensors [n, block_size, num_key_value_heads, head_dim]."""
        layers = self._kv_request(epoch, block_ids, layer_start, layer_end)
        return self.steps.loop.submit(self._export_kv, block_ids, layers)

    def write_kv(self, epoch: int, block_ids: list[int], kvs: list[tuple[torch.Tensor, torch.Tensor]],
                 scales: list[tuple[float, float]] | None = None) -> Future:
        """Write every KV head of the blocks, for every layer of this stage (kvs: [(k, v)] per layer; scales: their
        fp8 cache's (k_scale, v_scale) per layer, None from a cache of the model's dtype)."""
        s = self.cfg.settings
        layers = self._kv_request(epoch, block_ids, s.layer_start, s.layer_end)
        return self.steps.loop.submit(self._import_kv, block_ids, layers, kvs, scales)

    def _kv_request(self, epoch: int, block_ids: list[int], layer_start: int, layer_end: int) -> range:
        s = self.cfg.settings
        if epoch != self.epoch:
            raise StagemeshError(f"KV blocks of epoch {epoch} asked for, which is not the stage's")
        if not block_ids or len(block_ids) > self.limits.num_kv_blocks or \
                not all(0 <= b < self.limits.num_kv_blocks for b in block_ids):
            raise InvalidStep(f"KV block ids must be 1 to {self.limits.num_kv_blocks} ids below "
                              f"{self.limits.num_kv_blocks}")
        if not s.layer_start <= layer_start < layer_end <= s.layer_end:
            raise InvalidStep(f"layers {layer_start}:{layer_end} are not within this stage's {s.layer_start}:"
                              f"{s.layer_end}")
        return range(layer_start - s.layer_start, layer_end - s.layer_start)

    def _export_kv(self, block_ids: list[int], layers: range):
        self._tell_followers(control.KV_EXPORT, kv_transfer.encode(block_ids, layers))
        return kv_transfer.export_blocks(self.runner, block_ids, layers)

    def _import_kv(self, block_ids: list[int], layers: range, kvs, scales) -> None:
        cache = self.runner.kv_caches[0][0]
        # whole blocks (the scheduler's block_size), whatever this stage's DCP size keeps of them (kv_transfer)
        shape = (len(block_ids), self.runner.block_size, self.runner.config.num_key_value_heads, cache.shape[3])
        for k, v in kvs:
            if tuple(k.shape) != shape or tuple(v.shape) != shape:
                raise InvalidStep(f"KV of shape {tuple(k.shape)} for blocks of {shape}")
        if scales is not None and len(scales) != len(kvs):
            raise InvalidStep(f"{len(scales)} layers of KV scales for {len(kvs)} layers of KV")
        kvs = kv_transfer.convert_layers(self.runner, kvs, scales)
        self._tell_followers(control.KV_IMPORT, kv_transfer.encode(block_ids, layers))
        kv_transfer.import_blocks(self.runner, block_ids, layers, kvs, shape, cache.dtype)

    # -- KV tiers (stage_worker.kv_tiers) -----------------------------------------------------
    def store_kv(self, epoch: int, block_ids: list[int], host_slots: list[int], hashes: list[int],
                 to_disk: list[bool], disk_evictions: list[int]) -> Future:
        """Copy the blocks into the host tier (and queue the disk writes), on every TP rank, between steps."""
        self._check_tier_call(epoch, block_ids, host_slots, hashes, to_disk)
        if len(disk_evictions) > MAX_DISK_EVICTIONS or (disk_evictions and self.tiers.disk is None):
            raise InvalidStep(f"{len(disk_evictions)} disk evictions: a stage with a disk tier takes up to "
                              f"{MAX_DISK_EVICTIONS} per call")
        return self.steps.loop.submit(self._store_tiers, epoch, block_ids, host_slots, hashes, to_disk,
                                      disk_evictions)

    def begin_load(self, epoch: int, block_ids: list[int], host_slots: list[int], hashes: list[int]) -> int:
        """The checks of a LoadKV; the followers start reading their files. Rank 0 reads its own
        (self.tiers.read, off the step loop), then calls finish_load with the load's id."""
        self._check_tier_call(epoch, block_ids, host_slots, hashes)
        load_id = next(self._load_ids)
        if self.control is not None:
            self.control.send(control.KV_TIER_READ, epoch, kv_tier_ranks.encode_load(load_id, block_ids, host_slots,
                                                                                     hashes))
        return load_id

    def finish_load(self, load_id: int, epoch: int, block_ids: list[int], host_slots: list[int], hashes: list[int],
                    reads: list) -> Future:
        """Between steps: fill the blocks every TP rank can; a future of the flags."""
        return self.steps.loop.submit(self._fill_tiers, load_id, epoch, block_ids, host_slots, hashes, reads)

    def _check_tier_call(self, epoch: int, block_ids: list[int], host_slots: list[int], hashes: list[int],
                         to_disk: list[bool] | None = None) -> None:
        """A StoreKV (to_disk given) or LoadKV that does not fit the stage is refused before anything is touched."""
        if epoch != self.epoch:
            raise StagemeshError(f"KV tiers of epoch {epoch} asked for, which is not the stage's")
        n, blocks, slots = len(block_ids), self.limits.num_kv_blocks, self.tiers.num_host_blocks
        if len(host_slots) != n or len(hashes) != n or (to_disk is not None and len(to_disk) != n):
            raise InvalidStep("block_ids, host_slots, block_hashes (and to_disk) must have one entry per block")
        if n > blocks or not all(0 <= b < blocks for b in block_ids):
            raise InvalidStep(f"KV tier calls take up to {blocks} block ids below {blocks}")
        disk = self.tiers.disk is not None
        wants_disk = [s == -1 for s in host_slots] if to_disk is None else list(to_disk)
        if not all(0 <= s < slots or (s == -1 and wants_disk[i]) for i, s in enumerate(host_slots)):
            raise InvalidStep(f"host slots must be below {slots} (the host tier's size), or -1 for the disk tier")
        if any(wants_disk) and not disk:
            raise InvalidStep("this stage has no disk tier (--kv-offloading-disk-path)")
        used = block_ids if to_disk is None else [s for s in host_slots if s >= 0]
        if len(set(used)) != len(used):
            raise InvalidStep("a block id (LoadKV) or host slot (StoreKV) appears twice in one call")

    def _store_tiers(self, epoch: int, *args) -> None:
        if epoch != self.epoch:
            raise StagemeshError(f"KV tiers of epoch {epoch} asked for, which is not the stage's")
        self._tell_followers(control.KV_TIER_STORE, kv_tier_ranks.encode_store(*args))
        self.tiers.store(*args)

    def _fill_tiers(self, load_id: int, epoch: int, block_ids: list[int], host_slots: list[int], hashes: list[int],
                    reads: list) -> list[bool]:
        if epoch != self.epoch:
            raise StagemeshError(f"KV tiers of epoch {epoch} asked for, which is not the stage's")
        self._tell_followers(control.KV_TIER_FILL, kv_tier_ranks.encode_load(load_id, block_ids, host_slots, hashes))
        return kv_tier_ranks.finish_load(self.tiers, self.runner, block_ids, host_slots, hashes, reads)

    # -- LoRA adapters at run time (on the main loop: between steps, and torch on the thread that runs them) ----
    def load_lora(self, name: str, path: str) -> Future:
        """Read and serve an adapter on every TP rank (rank 0 checks it first: LoRAError names what is wrong)."""
        return self.steps.loop.submit(self._load_lora, name, path)

    def unload_lora(self, name: str) -> Future:
        return self.steps.loop.submit(self._unload_lora, name)

    def _load_lora(self, name: str, path: str) -> bool:
        if self.runner.lora is None:
            raise LoRAError(f"LoRA adapter {name!r}: this stage runs without --enable-lora")
        added = self.runner.lora.add(name, path)
        if added:
            self._tell_followers(control.LORA_LOAD, json.dumps({"name": name, "path": path}).encode(), any_epoch=True)
        return added

    def _unload_lora(self, name: str) -> bool:
        if self.runner.lora is None or not self.runner.lora.remove(name):
            return False
        self._tell_followers(control.LORA_UNLOAD, json.dumps({"name": name}).encode(), any_epoch=True)
        log.info("LoRA adapter %r unloaded", name)
        return True

    def _tell_followers(self, kind: int, payload: bytes, any_epoch: bool = False) -> None:
        """any_epoch: a message of no epoch (the followers act on it whatever epoch they are in, or none)."""
        if self.control is not None:
            self.control.send(kind, 0 if any_epoch else self.epoch, payload)

    def close(self) -> None:
        self.steps.abort()
        self.tiers.close()
        for proc in self.followers:
            proc.kill()
            proc.wait()
