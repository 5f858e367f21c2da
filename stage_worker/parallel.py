"""Tensor-parallel group of a stage and how it splits heads, KV heads and vocab."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from stagemesh.errors import StagemeshError
from stagemesh.model_config import ModelConfig


@dataclass
class TPGroup:
    """This process's place in its stage's TP group; size 1 needs no torch.distributed."""

    rank: int = 0
    size: int = 1
    group: Any = None  # a torch.distributed ProcessGroup when size > 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


@dataclass(frozen=True)
class HeadShard:
    """Which query heads and KV heads one TP rank owns."""

    q_start: int
    num_heads: int
    kv_start: int
    num_kv_heads: int

    @classmethod
    def for_rank(cls, cfg: ModelConfig, tp: TPGroup) -> "HeadShard":
        cfg.check_tp_size(tp.size)
        heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
        num_heads = heads // tp.size
        if tp.size <= kv:  # split the KV heads
            num_kv = kv // tp.size
            kv_start = tp.rank * num_kv
        else:  # replicate: each KV head serves tp.size // kv consecutive ranks
            num_kv = 1
            kv_start = tp.rank // (tp.size // kv)
        return cls(tp.rank * num_heads, num_heads, kv_start, num_kv)


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
