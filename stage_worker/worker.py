"""A stage's TP rank 0: owns the model slice, the TP followers' processes and the epochs.

Steps go through the stage's step executor (stage_worker.step_executor), which
the gRPC servicer (stage_worker.service) submits them to; this class starts the
followers, joins and leaves epochs, and reads and writes KV blocks between steps.
"""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import uuid
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from stagemesh.core.errors import StagemeshError
from stagemesh.core.speculative import SpeculativeConfig
from stagemesh.core.step import EpochSpec
from stagemesh.core.step_wire import epoch_to_pb
from stage_worker import control, eplb, kv_transfer
from stage_worker import dist as sdist
from stage_worker.draft import DraftModel
from stage_worker.ep_group import EPConfig, EPGroup
from stage_worker.kv_cache import num_kv_blocks_for_budget
from stage_worker.follower import follower_argv
from stage_worker.runner import SliceConfig
from stage_worker.step_executor import StepExecutor
from stage_worker.validate import InvalidStep, StepLimits, check_join

log = logging.getLogger("stagemesh.stage")


@dataclass(frozen=True)
class StageConfig:
    slice: SliceConfig
    stage_index: int
    handoff: str = "grpc"
    kv_cache_memory: int | None = None  # bytes; None: from gpu_memory_utilization (CUDA) or 512 MiB (CPU)
    gpu_memory_utilization: float = 0.9
    threads: int = 0  # of each TP follower (rank 0's are set by its command line)
    ep: EPConfig | None = None  # experts spread over the data-parallel replicas' stages (stage_worker.ep_group)
    standby: bool = False  # a spare for a served index (see scheduler.rendezvous): KV allocated at start
    speculative: SpeculativeConfig | None = None  # the last stage's draft model (stage_worker.draft)


class StageWorker:
    def __init__(self, cfg: StageConfig):
        if cfg.handoff not in ("nccl", "grpc"):
            raise StagemeshError(f"--handoff {cfg.handoff!r} must be nccl or grpc")
        self.cfg = cfg
        self.ep = EPGroup(cfg.ep, cfg.stage_index) if cfg.ep is not None else None
        self.runner = cfg.slice.runner(0, self.ep)
        if cfg.speculative is not None:  # before the KV budget is shared out: the draft's blocks count
            s = cfg.slice
            self.runner.attach_drafter(DraftModel(cfg.speculative, self.runner.config, self.runner.device, s.dtype,
                                                  s.block_size))
        self.followers = [self._start_follower(t) for t in range(1, cfg.slice.tp_size)]
        for t, proc in enumerate(self.followers, start=1):
            if proc.stdout.readline().strip() != b"ready":
                raise StagemeshError(f"TP follower {t} failed to load its shard (exit code {proc.wait()})")
        # what the followers are to do, all of it (stage_worker.control); None: no followers
        self.control = control.FollowerChannel(self.followers) if self.followers else None
        self.num_kv_blocks = num_kv_blocks_for_budget(self._kv_budget(), self.runner.kv_bytes_per_block)
        self.instance_id = uuid.uuid4().hex  # a restarted stage is another instance to the scheduler
        model = self.runner.config
        self._joining = threading.Lock()  # one join at a time (a second waits for the first to end)
        balancer = None if cfg.slice.eplb is None else eplb.Balancer(
            cfg.slice.eplb, eplb.balanced_blocks(self.runner.model), cfg.slice.tp_size, cfg.stage_index)
        # nothing is allowed before a join
        limits = StepLimits(model.vocab_size, model.hidden_size, cfg.slice.block_size)
        self.steps = StepExecutor(self.runner, cfg.stage_index, cfg.handoff, limits, self.control, self.ep,
                                  balancer)

    # -- start-up ---------------------------------------------------------------
    def _start_follower(self, tp_rank: int) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "stage_worker.follower", *follower_argv(self.cfg.slice, tp_rank, self.cfg.threads)]
        return subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=os.environ.copy())

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
        check_join(req, c.stage_index, c.slice.tp_size, self.num_kv_blocks, self.runner.config.max_position_embeddings,
                   self.runner.is_last_stage, c.handoff == "grpc" and not self.runner.is_last_stage)

    def join(self, req: EpochSpec) -> None:
        """Leave the old epoch (waking anything blocked in it) and join the new one."""
        with self._joining:
            self._join(req)

    def _join(self, req: EpochSpec) -> None:
        self._leave()
        if self.control is not None:
            self.control.send(control.JOIN, req.epoch, epoch_to_pb(req).SerializeToString())
        rank = sdist.join_world(req, self.runner.tp, self.runner.device)
        self.steps.loop.call(self.runner.reset, req.num_kv_blocks)
        self.steps.begin_epoch(req, rank)
        log.info("joined epoch %d as rank %d of %d (layers %d:%d, TP=%d, %s handoff, %d KV blocks)", req.epoch, rank,
                 req.world_size, self.cfg.slice.layer_start, self.cfg.slice.layer_end, self.cfg.slice.tp_size,
                 self.cfg.handoff,
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

    def write_kv(self, epoch: int, block_ids: list[int], kvs: list[tuple[torch.Tensor, torch.Tensor]]) -> Future:
        """Write every KV head of the blocks, for every layer of this stage (kvs: [(k, v)] per layer)."""
        s = self.cfg.slice
        layers = self._kv_request(epoch, block_ids, s.layer_start, s.layer_end)
        return self.steps.loop.submit(self._import_kv, block_ids, layers, kvs)

    def _kv_request(self, epoch: int, block_ids: list[int], layer_start: int, layer_end: int) -> range:
        s = self.cfg.slice
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

    def _import_kv(self, block_ids: list[int], layers: range, kvs) -> None:
        cache = self.runner.kv_caches[0][0]
        shape = (len(block_ids), cache.shape[1], self.runner.config.num_key_value_heads, cache.shape[3])
        for k, v in kvs:
            if tuple(k.shape) != shape or tuple(v.shape) != shape:
                raise InvalidStep(f"KV of shape {tuple(k.shape)} for blocks of {shape}")
        self._tell_followers(control.KV_IMPORT, kv_transfer.encode(block_ids, layers))
        kv_transfer.import_blocks(self.runner, block_ids, layers, kvs, shape, cache.dtype)

    def _tell_followers(self, kind: int, payload: bytes) -> None:
        if self.control is not None:
            self.control.send(kind, self.epoch, payload)

    def close(self) -> None:
        self.steps.abort()
        for proc in self.followers:
            proc.kill()
            proc.wait()
