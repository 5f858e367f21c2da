"""The scheduler core's settings, validated when built.

A replica's driver holds the settings a user gives (DriverConfig.scheduler) and
fills in what the pipeline decides when it forms (the KV cache's size, the
context length) with dataclasses.replace.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from scheduler.lora_table import LoRATable
from stagemesh.core.common_flags import (ADVERTISE_HOST, BLOCK_SIZE, GRAMMAR_COMPILE_TIMEOUT, HOST, KV_CACHE_DTYPE,
                                         MAX_MODEL_LEN, MAX_REQUEST_RETRIES, PIPELINE_PARALLEL_SIZE, SERVED_MODEL_NAME,
                                         SKIP_SERVER_WARMUP, SPECULATIVE_CONFIG, LoRAOptions, ModelOptions)
from stagemesh.core.deadlines import DEADLINES
from stagemesh.core.errors import StagemeshError
from stagemesh.core.kv_groups import FULL, blocks_at_most, tokens_held, usable_blocks
from stagemesh.core.flags import Flag, group
from stagemesh.core.service_options import ServiceOptions
from stagemesh.core.speculative import ASYNC_WITH_SPECULATION, SpeculativeConfig

KV_LOAD_FAILURE_POLICIES = ("fail", "recompute")  # vLLM's kv_load_failure_policy values (its default: fail)
MIGRATION_POLICIES = ("kv", "recompute")  # how a draining replica's running requests move (--migration-policy)


@dataclass(frozen=True)
class SchedulerOptions:
    """`stagemesh scheduler`'s command line, each flag declared once (serve passes the same ones on)."""
    source: ModelOptions = group(ModelOptions)
    host: str = HOST.field()
    port: int = Flag(("--port",), type=int, default=50051, help="gRPC port (0: any free port)").field()
    advertise_host: str | None = ADVERTISE_HOST.field()
    dist_port: int = Flag(("--dist-port",), type=int, default=0,
                          help="torch.distributed store port (0: any free port)").field()
    pipeline_parallel_size: int = PIPELINE_PARALLEL_SIZE.field()
    served_model_name: str | None = SERVED_MODEL_NAME.field()
    max_model_len: int | None = MAX_MODEL_LEN.field()
    max_num_seqs: int = Flag(("--max-num-seqs",), type=int, default=256).field()
    max_num_batched_tokens: int = Flag(("--max-num-batched-tokens",), type=int, default=2048).field()
    block_size: int = BLOCK_SIZE.field()
    kv_cache_dtype: str = KV_CACHE_DTYPE.field()
    enable_prefix_caching: bool = Flag(("--enable-prefix-caching",), kind="bool", default=True).field()
    max_waiting_requests: int = Flag(("--max-waiting-requests",), type=int, default=0, help="0: unbounded").field()
    lora: LoRAOptions = group(LoRAOptions)
    scheduling_policy: str = Flag(("--scheduling-policy",), default="fcfs", choices=("fcfs", "priority"), help=(
        "fcfs: requests in arrival order; priority: by the request's priority (lower first, ties by arrival), the "
        "lowest-priority running request preempted for a higher one that lacks KV blocks (vLLM's); a non-zero "
        "priority under fcfs is refused")).field()
    tenant_fair_share: bool = Flag(("--tenant-fair-share",), kind="bool", default=True, help=(
        "share the steps between the tenants of the requests (the router's --api-keys-file) by their weights: "
        "token-weighted fair queueing (the Virtual Token Counter), and a tenant under its share of --max-num-seqs "
        "takes a place from the tenant furthest over its own; within a tenant, --scheduling-policy's order. Off: "
        "the queues ignore tenants (first come, first served across them)")).field()
    async_scheduling: bool | None = Flag(("--async-scheduling",), kind="bool", help=(
        "schedule a step before the previous one's tokens are back, so the stages do not wait for the scheduler: "
        "always with one stage, with more where a micro-batch would be empty (default: on when the stages run on "
        "GPUs, off on CPU)")).field()
    speculative_config: str | None = SPECULATIVE_CONFIG.field()
    stage_recovery_timeout: float = Flag(("--stage-recovery-timeout",), type=float, default=30.0, help=(
        "when a stage fails, keep its requests this many seconds for the pipeline to re-form (the stage restarted, "
        "or a --standby stage took its place), then go on with them; after that they fail (the router continues "
        "them on another replica). 0: fail them at once")).field()
    max_request_retries: int = MAX_REQUEST_RETRIES.field()
    forward_timeout: float = Flag(("--forward-timeout",), type=float, default=DEADLINES.forward_s,
                                  help="deadline of one step on a stage, seconds").field()
    grammar_compile_timeout: float = GRAMMAR_COMPILE_TIMEOUT.field()
    skip_server_warmup: bool | None = SKIP_SERVER_WARMUP.field()
    kv_role: str = Flag(("--kv-role",), default="both", choices=("both", "prefill", "decode"), help=(
        "disaggregated prefill (docs/disaggregated-prefill.md): a router sends a prefill replica new prompts (it "
        "computes the prompt and the first token and holds the KV), and a decode replica the rest, whose stages "
        "fetch that KV; every role also serves whole requests")).field()
    kv_peer: tuple[str, ...] = Flag(("--kv-peer",), kind="append", default=(), metavar="HOST:PORT", help=(
        "the scheduler of a replica whose held KV this replica may fetch (repeat for each): a prefill replica's "
        "(disaggregated prefill), or another replica's whose requests move here with their KV when it drains "
        "(--migration-policy kv); a request's kv_transfer naming any other is not fetched (its "
        "--kv-load-failure-policy applies), and this replica's stages read KV only from these replicas' stages "
        "(`stagemesh serve` gives every decode replica the prefill ones, and without those every replica the "
        "others)")).field()
    migration_policy: str = Flag(("--migration-policy",), default="kv", choices=MIGRATION_POLICIES, help=(
        "what the running requests a draining replica could not finish within --shutdown-timeout do: kv (the "
        "default) goes on on another replica with their KV, read from this replica's stages over the KV transfer "
        "of disaggregated prefill (the other replica must name this one with --kv-peer; where it cannot load it, "
        "or a request is not between two steps of its decode, it is computed again there); recompute computes "
        "every one again there")).field()
    kv_hold_timeout: float = Flag(("--kv-hold-timeout",), type=float, default=30.0, metavar="SECONDS", help=(
        "a prefilled request's KV blocks wait this long at most for a decode replica to fetch them")).field()
    # (no `choices`: a wrong value is refused with the flag's name and what it takes, by check_kv_load_arguments)
    kv_load_failure_policy: str = Flag(("--kv-load-failure-policy",), default="fail", metavar="fail|recompute", help=(
        "vLLM's kv_load_failure_policy: what a request does whose prompt's KV cannot be loaded from its prefill "
        "replica (the fetch failed, ran past --kv-load-timeout, or the hold had expired): fail (the default, as "
        "vLLM's: it fails with the reason and the router prefills it again, once, on a prefill replica) or "
        "recompute (this replica computes its prompt)")).field()
    kv_load_timeout: float = Flag(("--kv-load-timeout",), type=float, default=10.0, metavar="SECONDS", help=(
        "bound on fetching a prompt's KV from a prefill replica; past it (a stalled prefill replica) the "
        "--kv-load-failure-policy applies")).field()
    resume_grace_period: float = Flag(("--resume-grace-period",), type=float, default=30.0, metavar="SECONDS", help=(
        "a streamed request whose router went away (died, or stopped) keeps running this long, its output kept, for "
        "another router to resume it (a client's Last-Event-ID, or stagemesh.client by itself); then it is aborted "
        "and its KV freed. 0: abort at once")).field()
    kv_offloading_size: float | None = Flag(("--kv-offloading-size",), type=float, metavar="GiB", help=(
        "KV tiers (vLLM's flag): host memory for KV blocks below the KV cache, in GiB for the whole replica (every "
        "stage and TP rank together); a prefix evicted from the KV cache, or cached before a new epoch, is loaded "
        "back from it instead of computed")).field()
    kv_offloading_backend: str | None = Flag(("--kv-offloading-backend",), choices=("native", "lmcache"), help=(
        "KV tiers (vLLM's flag): native, the built-in host and disk tiers (the default); lmcache is refused (not "
        "built in)")).field()
    kv_offloading_disk_size: float | None = Flag(("--kv-offloading-disk-size",), type=float, metavar="GiB", help=(
        "KV tiers: disk for KV blocks below the host tier, in GiB for the whole replica, in the stages' "
        "--kv-offloading-disk-path directories; it outlives the processes, so a restarted replica serves the "
        "prefixes it cached before (needs --kv-offloading-size)")).field()
    port_file: str | None = Flag(("--port-file",), help="write the bound port here (for supervisors)").field()
    service: ServiceOptions = group(ServiceOptions)


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
    tenant_fair_share: bool = True  # the steps shared between tenants by weight (scheduler.policy.FairShare)
    kv_hold_timeout_s: float = 30.0  # a prefilled request's KV blocks wait this long for a decode replica at most
    migration_policy: str = "kv"  # how a draining replica's running requests move on (--migration-policy)
    # decode side (scheduler.kv_transfer): vLLM's kv_load_failure_policy, what a request whose prompt's KV cannot be
    # loaded from its prefill replica does: "fail" (it ends with the reason; the router may prefill it again) or
    # "recompute" (its prompt is computed here); and the bound on that load (--kv-load-timeout)
    kv_load_failure_policy: str = "fail"
    kv_load_timeout_s: float = 10.0
    speculative: SpeculativeConfig | None = None  # vLLM's --speculative-config (scheduler.speculation)
    # --enable-lora: the adapters requests may ask for, and --max-loras, how many of them may run at once (the
    # stages hold that many in their slots); the table changes as adapters are loaded at run time
    lora: LoRATable | None = None
    # --runner pooling: the pooling tasks the pipeline's last stage serves, as it describes itself when the
    # pipeline forms (empty: it generates); requests it does not serve are refused (scheduler.admission)
    pooling_tasks: tuple[str, ...] = ()
    # the KV cache groups' sliding windows as the stages describe them (stagemesh.core.kv_groups; FULL: full
    # attention): (FULL,) is the plain paged cache, more groups free blocks out of their windows
    kv_group_windows: tuple[int, ...] = (FULL,)

    def __post_init__(self) -> None:
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise StagemeshError(f"{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise StagemeshError(f"scheduling-policy must be fcfs or priority, got {self.scheduling_policy!r}")
        if self.migration_policy not in MIGRATION_POLICIES:
            raise StagemeshError(f"--migration-policy must be kv or recompute, got {self.migration_policy!r}")
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
    def kv_lookback(self) -> int:
        """The tokens a step's result may take back (rejected drafts): kept in every sliding window."""
        return self.speculative.num_speculative_tokens if self.speculative is not None else 0

    @property
    def kv_cache_tokens(self) -> int:
        """The most tokens one request's KV can hold (a sliding group holding only its window's)."""
        return tokens_held(self.kv_group_windows, self.num_kv_blocks, self.block_size, self._chunk, self.kv_lookback)

    def kv_blocks_for(self, num_tokens: int) -> int:
        """The most blocks a request of num_tokens holds at once (every group's)."""
        return blocks_at_most(self.kv_group_windows, num_tokens, self.block_size, self._chunk, self.kv_lookback)

    def fits_kv_cache(self, num_tokens: int) -> bool:
        """Whether a request of num_tokens can ever have its blocks."""
        return self.kv_blocks_for(num_tokens) <= usable_blocks(self.kv_group_windows, self.num_kv_blocks)

    @property
    def _chunk(self) -> int:
        """The most tokens a step computes of a request (with a speculation's lookahead)."""
        return self.max_num_batched_tokens + self.kv_lookback


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
    # dummy steps through each new pipeline before the replica serves (scheduler.warmup); off with
    # --skip-server-warmup, and where a test's pipeline answers each step by hand
    warm_up: bool = True
    # a structured request waits unscheduled while its last stage compiles its constraint, at most this long
    grammar_compile_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        if self.async_scheduling and self.scheduler.speculative is not None:
            raise StagemeshError(ASYNC_WITH_SPECULATION)
