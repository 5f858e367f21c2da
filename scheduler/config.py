"""The scheduler core's settings, validated when built.

A replica's driver holds the settings a user gives (DriverConfig.scheduler) and
fills in what the pipeline decides when it forms (the KV cache's size, the
context length) with dataclasses.replace.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from scheduler.lora_table import LoRATable
from stagemesh.core.errors import StagemeshError
from stagemesh.core.speculative import ASYNC_WITH_SPECULATION, SpeculativeConfig

KV_LOAD_FAILURE_POLICIES = ("fail", "recompute")  # vLLM's kv_load_failure_policy values (its default: fail)


@dataclass(frozen=True)
class SchedulerConfig:
    num_kv_blocks: int = 0  # 0: decided when the pipeline forms
    # the KV tiers' blocks (scheduler.tiers), decided when the pipeline forms from DriverConfig's sizes
    num_host_kv_blocks: int = 0
    num_disk_kv_blocks: int = 0
    max_model_len: int | None = None  # None: the model's, capped by the KV cache, when the pipeline forms
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    eos_token_ids: tuple[int, ...] = ()
    max_waiting_requests: int = 0  # 0: unbounded
    async_scheduling: bool = False  # may schedule a step ahead of a request's tokens (see Scheduler)
    vocab_size: int | None = None  # prompt and stop token ids are checked against it when known
    # vLLM's --scheduling-policy: "fcfs" (arrival order) or "priority" (lower value first, ties by arrival;
    # the lowest-priority running request is preempted for a higher one that lacks KV blocks)
    scheduling_policy: str = "fcfs"
    kv_hold_timeout_s: float = 30.0  # a prefilled request's KV blocks wait this long for a decode replica at most
    # decode side (scheduler.kv_transfer): vLLM's kv_load_failure_policy, what a request whose prompt's KV cannot be
    # loaded from its prefill replica does: "fail" (it ends with the reason; the router may prefill it again) or
    # "recompute" (its prompt is computed here); and the bound on that load (--kv-load-timeout)
    kv_load_failure_policy: str = "fail"
    kv_load_timeout_s: float = 10.0
    speculative: SpeculativeConfig | None = None  # vLLM's --speculative-config (scheduler.speculation)
    # --enable-lora: the adapters requests may ask for, and --max-loras, how many of them may run at once (the
    # stages hold that many in their slots); the table changes as adapters are loaded at run time
    lora: LoRATable | None = None

    def __post_init__(self) -> None:
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise StagemeshError(f"{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise StagemeshError(f"scheduling-policy must be fcfs or priority, got {self.scheduling_policy!r}")
        if self.kv_load_failure_policy not in KV_LOAD_FAILURE_POLICIES:
            raise StagemeshError(f"--kv-load-failure-policy must be fail or recompute, got "
                                 f"{self.kv_load_failure_policy!r}")
        if not self.kv_load_timeout_s > 0:
            raise StagemeshError(f"--kv-load-timeout must be > 0 seconds, got {self.kv_load_timeout_s}")
        if self.speculative is not None and self.async_scheduling:
            raise StagemeshError(ASYNC_WITH_SPECULATION)

    def check_formed(self) -> int:
        """The settings a scheduler runs with: the pipeline's part filled in. Returns max_model_len."""
        if self.num_kv_blocks < 1 or self.max_model_len is None or self.max_model_len < 1:
            raise StagemeshError(f"num_kv_blocks ({self.num_kv_blocks}) and max_model_len ({self.max_model_len}) "
                                 "must be >= 1")
        return self.max_model_len

    @property
    def kv_cache_tokens(self) -> int:
        return self.num_kv_blocks * self.block_size


@dataclass(frozen=True)
class DriverConfig:
    # the scheduler's settings; the KV cache size and the context length are decided when the pipeline forms
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    model_max_len: int = 1 << 31  # the model's positions: max_model_len when the scheduler's is None
    probe_interval_s: float = 2.0
    stage_recovery_timeout_s: float = 30.0  # how long requests are kept for a pipeline to re-form (0: fail at once)
    max_request_retries: int = 3  # pipelines that may break under a request before it fails
    async_scheduling: bool | None = None  # None: on when every stage computes on a GPU (EpochManager._start)
    # KV tiers (docs/kv-tiers.md), bytes for the whole replica (every stage and TP rank): vLLM's
    # --kv-offloading-size (host memory) and stagemesh's --kv-offloading-disk-size; 0: none
    kv_offloading_bytes: int = 0
    kv_offloading_disk_bytes: int = 0

    def __post_init__(self) -> None:
        if self.async_scheduling and self.scheduler.speculative is not None:
            raise StagemeshError(ASYNC_WITH_SPECULATION)
