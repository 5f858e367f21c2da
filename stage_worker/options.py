"""`stagemesh stage`'s command line (StageOptions), each flag declared once (stagemesh.core.flags): `stagemesh
serve` composes its own flags from these and starts each stage with a StageOptions of its own."""
from __future__ import annotations

from dataclasses import dataclass

from stagemesh.core.common_flags import (ADVERTISE_HOST, BLOCK_SIZE, HOST, KV_CACHE_DTYPE, PIPELINE_PARALLEL_SIZE,
                                         SPECULATIVE_CONFIG, LoRAOptions, ModelOptions, PoolingOptions)
from stagemesh.core.flags import Flag, group
from stagemesh.core.service_options import ServiceOptions


@dataclass(frozen=True)
class StageOptions:
    scheduler: str | None = Flag(("--scheduler",), required=True, metavar="HOST:PORT",
                                 help="the replica's scheduler").field()
    stage_index: int | None = Flag(("--stage-index",), type=int, required=True).field()
    layers: str | None = Flag(("--layers",), metavar="A:B", help=(
        "this stage's layers [A, B); or give --pipeline-parallel-size (and --layer-split) instead")).field()
    pipeline_parallel_size: int | None = PIPELINE_PARALLEL_SIZE.field(default=None, help=(
        "without --layers: this stage takes its --stage-index's share of a split into this many stages (balanced, "
        "as `stagemesh serve` splits, unless --layer-split), so that every stage of a pipeline can run one command "
        "(a Kubernetes StatefulSet)"))
    layer_split: str | None = Flag(("--layer-split",), help=(
        "layers per stage, e.g. 10,12,8 (default: balanced; a stage's: with --pipeline-parallel-size)")).field()
    tensor_parallel_size: int = Flag(("--tensor-parallel-size", "-tp"), type=int, default=1).field()
    decode_context_parallel_size: int = Flag(("--decode-context-parallel-size", "-dcp"), type=int, default=1, help=(
        "vLLM's DCP: each group of this many TP ranks holds the same KV heads (sharded as if TP were tp / dcp) and "
        "each a share of every sequence's tokens, so a replica holds dcp times the tokens where TP alone would "
        "replicate KV heads (TP > KV heads); must divide --tensor-parallel-size and --block-size "
        "(docs/context-parallelism.md)")).field()
    prefill_context_parallel_size: int = Flag(("--prefill-context-parallel-size", "-pcp"), type=int, default=1, help=(
        "vLLM's PCP: the stage runs as tp x pcp processes, each PCP group of pcp ranks holding the stage's weights "
        "(TP-sharded over the groups) and each rank computing the tokens whose KV it keeps (block_size / pcp of "
        "every block), so a long prompt's prefill is split over them and a sequence's KV too; must divide "
        "--block-size (docs/context-parallelism.md)")).field()
    device: str | None = Flag(("--device",), default="cpu", choices=("cpu", "cuda")).field()
    handoff: str = Flag(("--handoff",), default="grpc", choices=("nccl", "grpc"),
                        help="activation transport to the next stage").field()
    host: str = HOST.field()
    port: int = Flag(("--port",), type=int, default=0, help="gRPC port (0: any free port)").field()
    advertise_host: str | None = ADVERTISE_HOST.field()
    block_size: int = BLOCK_SIZE.field()
    kv_cache_memory: int | None = Flag(("--kv-cache-memory",), type=int, help="KV cache budget in bytes").field()
    kv_cache_dtype: str = KV_CACHE_DTYPE.field()
    calculate_kv_scales: bool = Flag(("--calculate-kv-scales",), kind="switch", help=(
        "vLLM's: with --kv-cache-dtype fp8, each layer's k_scale and v_scale from the first forward's keys and values "
        "(max|K| / 200, max|V| / 100, over the stage's ranks), in place of the checkpoint's or 1.0")).field()
    gpu_memory_utilization: float = Flag(("--gpu-memory-utilization",), type=float, default=0.9).field()
    dtype: str | None = Flag(("--dtype",), help="auto, float32, bfloat16, float16").field()
    enforce_eager: bool = Flag(("--enforce-eager",), kind="switch",
                               help="no CUDA graphs for decode steps (as vLLM)").field()
    enable_expert_parallel: bool = Flag(("--enable-expert-parallel",), kind="switch", help=(
        "MoE models: whole experts spread over the stage's TP ranks (EP size = TP size) instead of every expert "
        "sharded over them; attention stays TP; with --data-parallel-size > 1 over the replicas' stages "
        "(data-parallel attention)")).field()
    enable_eplb: bool = Flag(("--enable-eplb",), kind="switch", help=(
        "with --enable-expert-parallel: balance the experts' load over the TP ranks (vLLM's EPLB): redundant copies "
        "of hot experts, re-placed every step_interval steps (stage_worker.eplb)")).field()
    eplb_config: str | None = Flag(("--eplb-config",), metavar="JSON", help=(
        'vLLM\'s EPLB settings: {"window_size": 1000, "step_interval": 3000, "num_redundant_experts": 0, '
        '"log_balancedness": false}')).field()
    # vLLM's flags for data-parallel attention with experts across the replicas (stage_worker.ep_group)
    data_parallel_size: int = Flag(("--data-parallel-size", "-dp"), type=int, default=1, help=(
        "with --enable-expert-parallel: the experts of this stage's layers are spread over the stages of this many "
        "replicas (each replica runs attention on its own requests)")).field()
    data_parallel_rank: int = Flag(("--data-parallel-rank",), type=int, default=0,
                                   help="this stage's replica among them").field()
    data_parallel_address: str = Flag(("--data-parallel-address",), default="127.0.0.1",
                                      help="where replica 0's stage hosts the expert-parallel group's store").field()
    data_parallel_rpc_port: int = Flag(("--data-parallel-rpc-port",), type=int, default=29550,
                                       help="the store's port for stage 0's group (stage i's: this + i)").field()
    standby: bool = Flag(("--standby",), kind="switch", help=(
        "a spare: when another live stage serves this --stage-index, the scheduler keeps this one warm (weights "
        "loaded, KV cache allocated) and swaps it in when that stage fails; otherwise it serves as any stage"
    )).field()
    speculative_config: str | None = SPECULATIVE_CONFIG.field()
    kv_offloading_disk_path: str | None = Flag(("--kv-offloading-disk-path",), metavar="DIR", help=(
        "the disk tier of this stage's KV (docs/kv-tiers.md): blocks the scheduler moves there are files under "
        "DIR/<namespace>/ (a digest of the model, dtype, block size, heads, layers, TP size and quantization, so a "
        "changed model never reads them), kept across restarts. One stage process per namespace directory: give "
        "each replica a DIR of its own (a second stage on it is refused; `stagemesh serve` uses DIR/replica-<i>)"
    )).field()
    threads: int = Flag(("--threads",), type=int, default=0,
                        help="torch threads per process (0: torch's default)").field()
    cpu_affinity: str | None = Flag(("--cpu-affinity",), metavar="CPUS",
                                    help="pin the stage (and followers) to these cores, e.g. 0 or 0,1").field()
    source: ModelOptions = group(ModelOptions)
    lora: LoRAOptions = group(LoRAOptions)
    pooling: PoolingOptions = group(PoolingOptions)
    service: ServiceOptions = group(ServiceOptions)
