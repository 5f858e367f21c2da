"""Tensor-parallel group of a stage and how it splits heads, KV heads and vocab."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from stagemesh.core.errors import StagemeshError
from stagemesh.core.model_config import ModelConfig


@dataclass
class TPGroup:
    """This process's place in its stage's TP group; size 1 needs no torch.distributed. With prefill context
    parallelism (`pcp`) the group is the stage's tp x pcp ranks, and `shard` the TP group of its weights.

    A CPU group on one host moves its collectives through shared memory (`shm`, see
    stage_worker.dist.attach_shm), gloo being a loopback-TCP round trip per collective;
    tensors too large for its slots, and GPU groups (NCCL), go through `group`. Every rank
    takes the same path for a collective: it depends only on the tensor's size and layout."""

    rank: int = 0
    size: int = 1
    group: Any = None  # a torch.distributed ProcessGroup when size > 1
    shm: Any = None  # kernels' ShmComm of this group, or None
    src: int = 0  # global rank of TP rank 0, the source of broadcasts
    # decode context parallelism (--decode-context-parallel-size): each `cp_size` consecutive ranks hold the same
    # KV heads (sharded as if TP were size // cp_size) and each a share of every sequence's tokens
    cp_size: int = 1  # the ranks that share a sequence's KV (DCP's or PCP's group)
    # prefill context parallelism (--prefill-context-parallel-size): the group is the stage's tp x pcp ranks, in PCP
    # groups of cp_size (= pcp) consecutive ranks, each rank with a share of the step's tokens (those whose KV it
    # keeps) and its PCP group's TP shard of the weights
    pcp: bool = False
    # with PCP: the TP group this rank's weights are sharded over (shard rank // cp_size, with the ranks of the
    # same place in the other PCP groups), formed as an epoch is joined (stage_worker.dist.join_shard_group)
    shard: "TPGroup | None" = None

    def _fits_shm(self, x: torch.Tensor) -> bool:
        return (self.shm is not None and x.device.type == "cpu" and x.is_contiguous()
                and x.numel() * x.element_size() <= self.shm.slot_bytes())

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            if x.dtype == torch.float32 and self._fits_shm(x):
                self.shm.all_reduce(x)
            else:
                dist.all_reduce(x, group=self.group)
        return x

    def all_reduce_max(self, x: torch.Tensor) -> torch.Tensor:
        """The element-wise maximum over the group, in place (rare: the KV scales of --calculate-kv-scales)."""
        if self.size > 1:
            dist.all_reduce(x, op=dist.ReduceOp.MAX, group=self.group)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        x = x.contiguous()
        if self._fits_shm(x):
            return torch.cat(self.shm.all_gather(x).unbind(0), dim=-1)
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=-1)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """[size, *x.shape]: every rank's x, in rank order."""
        x = x.contiguous()
        if self.size == 1:
            return x[None]
        if self._fits_shm(x):
            return self.shm.all_gather(x)
        out = torch.empty((self.size, *x.shape), dtype=x.dtype, device=x.device)
        dist.all_gather(list(out.unbind(0)), x, group=self.group)
        return out

    @property
    def cp_rank(self) -> int:
        """This rank's place in its DCP group (which share of each block's tokens it holds)."""
        return self.rank % self.cp_size

    def cp_gather(self, x: torch.Tensor) -> torch.Tensor:
        """[cp_size, *x.shape]: the x of each rank of this rank's DCP or PCP group, in order. The group's collective is
        the TP group's all-gather, the other groups' parts dropped (no process group of its own to form per
        epoch; the same bytes when the DCP group is the whole TP group, as it is when the sizes are equal)."""
        parts = self.all_gather(x)
        if self.cp_size == self.size:
            return parts
        first = self.rank - self.cp_rank
        return parts[first:first + self.cp_size]

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """x from TP rank 0 to every rank, in place."""
        if self._fits_shm(x):
            self.shm.broadcast(x, 0)
        else:
            dist.broadcast(x, src=self.src, group=self.group)
        return x


def stage_groups(rank: int, tp_size: int, dcp_size: int = 1, pcp_size: int = 1, group=None,
                 shard_group=None) -> tuple[TPGroup, TPGroup]:
    """The stage's group of process `rank` (its tp x pcp ranks), and the TP group its weights are sharded over:
    the same group without PCP; with it, ranks t * pcp .. (t + 1) * pcp - 1 form PCP group t, which holds TP
    shard t (its TP group formed as an epoch is joined: stage_worker.dist.join_shard_group, or `shard_group`)."""
    if pcp_size == 1:
        tp = TPGroup(rank, tp_size, group, cp_size=dcp_size)
        return tp, tp
    shard = TPGroup(rank // pcp_size, tp_size, shard_group)
    return TPGroup(rank, tp_size * pcp_size, group, cp_size=pcp_size, pcp=True, shard=shard), shard


@dataclass(frozen=True, eq=False)
class StageParallel:
    """How a stage's layers are spread over processes, as its model's layers are built with it: the TP group, expert
    parallelism (the experts split over the TP ranks; `ep`: the group of members without rows of their own,
    stage_worker.ep_group; `eplb`: the experts' load balancer, stage_worker.eplb), and `cp`, the group a sequence's
    KV is spread over with decode or prefill context parallelism (stage_worker.context), or None."""
    tp: TPGroup
    expert_parallel: bool = False
    ep: Any = None
    eplb: Any = None
    cp: TPGroup | None = None


@dataclass(frozen=True)
class HeadShard:
    """Which query heads and KV heads one TP rank owns."""

    q_start: int
    num_heads: int
    kv_start: int
    num_kv_heads: int

    @classmethod
    def for_rank(cls, cfg: ModelConfig, tp: TPGroup) -> "HeadShard":
        """The query heads split over the TP group; the KV heads over its DCP groups (each group's ranks hold
        the same KV heads: those of the group's query heads, and each a share of the tokens)."""
        heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
        groups, group = tp.size // tp.cp_size, tp.rank // tp.cp_size
        # (with PCP a rank has its TP shard's query heads, of its share of the tokens: the shard is its group)
        shards, shard = (groups, group) if tp.pcp else (tp.size, tp.rank)
        cfg.check_tp_size(shards)
        num_heads = heads // shards
        if groups <= kv:  # split the KV heads
            num_kv = kv // groups
            kv_start = group * num_kv
        else:  # replicate: each KV head serves groups // kv consecutive groups
            num_kv = 1
            kv_start = group // (groups // kv)
        return cls(shard * num_heads, num_heads, kv_start, num_kv)


def shard_range(total: int, tp: TPGroup, what: str) -> tuple[int, int]:
    """[start, stop) of an evenly split dimension (intermediate size)."""
    if total % tp.size:
        raise StagemeshError(f"{what} ({total}) is not divisible by --tensor-parallel-size {tp.size}")
    per = total // tp.size
    return tp.rank * per, per


def vocab_range(vocab_size: int, tp: TPGroup) -> tuple[int, int, int]:
    """(start, stop, padded rows per rank) of this rank's vocabulary slice."""
    per = -(-vocab_size // tp.size)
    start = min(tp.rank * per, vocab_size)
    return start, min(start + per, vocab_size), per
