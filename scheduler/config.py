"""The scheduler core's settings, validated when built."""
from __future__ import annotations

from dataclasses import dataclass

from stagemesh.errors import StagemeshError


@dataclass(frozen=True)
class SchedulerConfig:
    num_kv_blocks: int
    max_model_len: int
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    eos_token_ids: tuple[int, ...] = ()
    max_waiting_requests: int = 0  # 0: unbounded
    async_scheduling: bool = False  # may schedule a step ahead of a request's tokens (see Scheduler)
    vocab_size: int | None = None  # prompt and stop token ids are checked against it when known

    def __post_init__(self) -> None:
        for name in ("num_kv_blocks", "max_model_len", "block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise StagemeshError(f"{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")

    @property
    def kv_cache_tokens(self) -> int:
        return self.num_kv_blocks * self.block_size
