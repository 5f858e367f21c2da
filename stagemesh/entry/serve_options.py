"""`stagemesh serve`'s command line (ServeOptions): the services' own flags, taken from their options (one
declaration each: stagemesh.core.flags.flag_of) where serve passes them on, and the flags of serve alone
(the layout, the backend, the restart policy). A taken flag whose default or help is serve's own says so
with a variant (SERVE_VARIANTS), since serve means more by it (a default it decides, or passes on changed)."""
from __future__ import annotations

from dataclasses import dataclass

from router.config import RouterOptions
from scheduler.config import SchedulerOptions
from stage_worker.options import StageOptions
from stage_worker.settings import StageSettings
from stagemesh.core.common_flags import LoRAOptions, ModelOptions, PoolingOptions
from stagemesh.core.flags import Flag, flag_of, group
from stagemesh.core.service_options import ServiceOptions
from stagemesh.entry.ops.admin_file import ENV_KEY as ADMIN_KEY_ENV

# On Ray a stage may be lost with its node: Ray declares a node dead after missing its health checks (about
# 15 s by default), then places the stage elsewhere and it loads its weights; 30 s would not cover that.
RAY_STAGE_RECOVERY_TIMEOUT_S = 90.0
R, S, W = RouterOptions, SchedulerOptions, StageOptions  # (W: the stage worker's)
# the flags serve takes from a service with a default or help of its own, and why
SERVE_VARIANTS = {
    "--host": "the router's, named so", "--port": "the router's, named so",
    "--grpc-port": "serve turns the router's gRPC frontend on by default",
    "--handoff": "serve's stages hand off with NCCL by default (a CPU stage falls back to gRPC)",
    "--device": "serve chooses CUDA when there is a GPU",
    "--threads": "serve's 0 is its CPU plan; it gives each stage a number",
    "--data-parallel-size": "serve's replicas (a stage's: the replicas its experts span)",
    "--stage-recovery-timeout": "serve's default depends on the backend (Ray: 90)",
}


OPS = "operations: the admin API (stagemesh rollout, stagemesh scale) and the autoscaler"


@dataclass(frozen=True)
class OpsOptions:
    """serve's admin API and autoscaler (stagemesh.entry.ops.serve_ops)."""
    admin_host: str = Flag(("--admin-host",), default="127.0.0.1", title=OPS,
                           help="the admin API's address (default: loopback only)").field()
    admin_port: int = Flag(("--admin-port",), type=int, default=0, title=OPS, help=(
        "the admin API's port (default 0: any free port; the commands on this host find it in the stagemesh cache, "
        "admin/serve-<pid>.json)")).field()
    admin_api_key: str | None = Flag(("--admin-api-key",), metavar="KEY", title=OPS, help=(
        f"the key every admin call must carry (default: ${ADMIN_KEY_ENV}; neither: serve generates one and keeps "
        "it, mode 0600, in its admin file for the commands on this host)")).field()
    autoscale_min_replicas: int | None = Flag(("--autoscale-min-replicas",), type=int, metavar="N", title=OPS, help=(
        "the autoscaler keeps at least N replicas (default 1, or --prefill-replicas + 1)")).field()
    autoscale_max_replicas: int | None = Flag(("--autoscale-max-replicas",), type=int, metavar="N", title=OPS, help=(
        "turn the autoscaler on: it adds replicas up to N under load and removes them after (docs/operations.md)"
    )).field()
    autoscale_target_waiting: float = Flag(("--autoscale-target-waiting",), type=float, default=4.0,
                                           metavar="REQUESTS", title=OPS,
                                           help="grow when more requests than this wait per replica (default 4)"
                                           ).field()
    autoscale_target_kv_usage: float = Flag(("--autoscale-target-kv-usage",), type=float, default=0.8,
                                            metavar="FRACTION", title=OPS, help=(
        "grow when the replicas' mean KV cache usage passes this (default 0.8)")).field()
    autoscale_scale_up_window: float = Flag(("--autoscale-scale-up-window",), type=float, default=30.0,
                                            metavar="SECONDS", title=OPS, help=(
        "how long the load must stay above a target before a replica is added (default 30)")).field()
    autoscale_scale_down_window: float = Flag(("--autoscale-scale-down-window",), type=float, default=300.0,
                                              metavar="SECONDS", title=OPS, help=(
        "how long one replica fewer must look enough before one is removed (default 300)")).field()
    autoscale_cooldown: float = Flag(("--autoscale-cooldown",), type=float, default=60.0, metavar="SECONDS",
                                     title=OPS, help="no change this long after the last one (default 60)").field()
    autoscale_interval: float = Flag(("--autoscale-interval",), type=float, default=2.0, metavar="SECONDS",
                                     title=OPS, help="seconds between two looks at the replicas' load (default 2)"
                                     ).field()


@dataclass(frozen=True)
class ServeOptions:
    # a stage's settings, every one passed on to each stage as given (a new one is serve's without a line here);
    # the LoRA and pooling groups are declared below, as the other services share them, and the two
    # whose meaning serve changes (SERVE_VARIANTS) likewise
    stage: StageSettings = group(StageSettings, skip=("device", "threads", "lora", "pooling"))
    pipeline_parallel_size: int = flag_of(S, "pipeline_parallel_size")
    data_parallel_size: int = flag_of(W, "data_parallel_size", help=None)
    layer_split: str | None = flag_of(W, "layer_split")
    handoff: str = flag_of(W, "handoff", default="nccl", help=None)
    device: str | None = flag_of(W, "device", default=None, help="default: cuda when available")
    host: str = flag_of(R, "host", help="the router's HTTP address")
    port: int = flag_of(R, "port", help="the router's HTTP port")
    grpc_port: int | None = flag_of(R, "grpc_port", default=50050, help="the router's gRPC frontend port")
    rebalance_interval: float = flag_of(R, "rebalance_interval")
    rebalance_min_gap: int = flag_of(R, "rebalance_min_gap")
    api_server_count: int = Flag(("--api-server-count", "-asc"), type=int, default=1, metavar="N", help=(
        "routers (vLLM's API servers) over the replicas, sharing the HTTP and gRPC ports (SO_REUSEPORT: the kernel "
        "spreads connections over them); one that dies or is upgraded loses no stream a client resumes "
        "(Last-Event-ID; stagemesh.client does it by itself)")).field()
    resume_grace_period: float = flag_of(S, "resume_grace_period")
    served_model_name: str | None = flag_of(R, "served_model_name")
    api_key: str | None = flag_of(R, "api_key")
    api_keys_file: str | None = flag_of(R, "api_keys_file")
    max_queue_wait: float = flag_of(R, "max_queue_wait")
    max_model_len: int | None = flag_of(R, "max_model_len")
    enable_auto_tool_choice: bool | None = flag_of(R, "enable_auto_tool_choice")
    tool_call_parser: str | None = flag_of(R, "tool_call_parser")
    reasoning_parser: str | None = flag_of(R, "reasoning_parser")
    responses_store: str = flag_of(R, "responses_store")
    responses_store_size: int | None = flag_of(R, "responses_store_size")
    responses_store_ttl: float | None = flag_of(R, "responses_store_ttl")
    trust_request_chat_template: bool = flag_of(R, "trust_request_chat_template")
    chat_template_timeout: float = flag_of(R, "chat_template_timeout")
    structured_outputs_config: str | None = flag_of(R, "structured_outputs_config")
    grammar_compile_timeout: float = flag_of(R, "grammar_compile_timeout")
    generation_config: str = flag_of(R, "generation_config")
    override_generation_config: str | None = flag_of(R, "override_generation_config")
    max_num_seqs: int = flag_of(S, "max_num_seqs")
    max_num_batched_tokens: int = flag_of(S, "max_num_batched_tokens")
    scheduling_policy: str = flag_of(S, "scheduling_policy")
    tenant_fair_share: bool = flag_of(S, "tenant_fair_share")
    migration_policy: str = flag_of(S, "migration_policy")
    enable_prefix_caching: bool = flag_of(S, "enable_prefix_caching")
    async_scheduling: bool | None = flag_of(S, "async_scheduling")
    speculative_config: str | None = flag_of(S, "speculative_config")
    kv_cache_memory: int | None = flag_of(W, "kv_cache_memory")
    kv_offloading_size: float | None = flag_of(S, "kv_offloading_size")
    kv_offloading_backend: str | None = flag_of(S, "kv_offloading_backend")
    kv_offloading_disk_size: float | None = flag_of(S, "kv_offloading_disk_size")
    lora: LoRAOptions = group(LoRAOptions)
    pooling: PoolingOptions = group(PoolingOptions)
    kv_offloading_disk_path: str | None = flag_of(W, "kv_offloading_disk_path")
    gpu_memory_utilization: float = flag_of(W, "gpu_memory_utilization")
    prefill_replicas: int = Flag(("--prefill-replicas",), type=int, default=0, metavar="N", help=(
        "disaggregated prefill: of the --data-parallel-size replicas, the first N compute new prompts (--kv-role "
        "prefill) and the others decode (--kv-role decode), fetching the prompts' KV "
        "(docs/disaggregated-prefill.md); 0: every replica does both")).field()
    kv_load_failure_policy: str = flag_of(S, "kv_load_failure_policy")
    kv_load_timeout: float = flag_of(S, "kv_load_timeout")
    policy: str = flag_of(R, "policy")
    batch_dir: str | None = flag_of(R, "batch_dir")
    batch_max_file_bytes: int = flag_of(R, "batch_max_file_bytes")
    batch_concurrency: int = flag_of(R, "batch_concurrency")
    stream_interval: int = flag_of(R, "stream_interval")
    stage_recovery_timeout: float | None = flag_of(S, "stage_recovery_timeout", default=None, help=(
        "seconds a replica keeps its requests for a failed stage to come back (see `stagemesh scheduler`; default "
        f"30, or {RAY_STAGE_RECOVERY_TIMEOUT_S:.0f} on Ray)"))
    max_request_retries: int = flag_of(S, "max_request_retries")
    threads: int = flag_of(W, "threads", help=(
        "torch threads per stage process (0: serve's CPU plan: the cores, less one kept for the frontend on 8+ "
        "cores, over the stage processes; docs/cpu-plan.md)"))
    restart_policy: str = Flag(("--restart-policy",), default="on-failure", choices=("on-failure", "never"), help=(
        "on-failure: a child that dies is restarted with backoff while the rest serve; never: the first death stops "
        "the mesh (debugging)")).field()
    distributed_executor_backend: str = Flag(("--distributed-executor-backend",), default="mp", choices=("mp", "ray"),
                                             help=(
        "mp: every service a child process of this one, on this host; ray: the services run on the Ray cluster this "
        "node belongs to (`ray start --head` here, `ray start --address` on the others, or RAY_ADDRESS): the router "
        "and the schedulers on this node, each stage with its TP ranks in a placement group of its own wherever Ray "
        "finds room, restarted and re-placed by Ray when it or its node dies (docs/ray.md). With ray, --threads is "
        "the CPUs each TP rank asks of Ray (default 1) and --stage-recovery-timeout defaults to "
        f"{RAY_STAGE_RECOVERY_TIMEOUT_S:.0f}")).field()
    # --metrics-port P: scheduler of replica r on P + r*(PP+1), its stages next, serve's own after them all
    source: ModelOptions = group(ModelOptions)
    ops: OpsOptions = group(OpsOptions)
    service: ServiceOptions = group(ServiceOptions)
