"""`stagemesh stage`'s command line (StageOptions), each flag declared once (stagemesh.core.flags): `stagemesh
serve` composes its own flags from these and starts each stage with a StageOptions of its own. The flags every
TP rank of the stage reads are its StageSettings' (stage_worker.settings), nested here as a group."""
from __future__ import annotations

from dataclasses import dataclass

from stagemesh.core.common_flags import ADVERTISE_HOST, HOST, PIPELINE_PARALLEL_SIZE, SPECULATIVE_CONFIG, ModelOptions
from stagemesh.core.flags import Flag, group
from stagemesh.core.service_options import ServiceOptions
from stage_worker.settings import StageSettings


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
    settings: StageSettings = group(StageSettings)  # the model slice's flags (stage_worker.settings)
    handoff: str = Flag(("--handoff",), default="grpc", choices=("nccl", "grpc"),
                        help="activation transport to the next stage").field()
    host: str = HOST.field()
    port: int = Flag(("--port",), type=int, default=0, help="gRPC port (0: any free port)").field()
    advertise_host: str | None = ADVERTISE_HOST.field()
    kv_cache_memory: int | None = Flag(("--kv-cache-memory",), type=int, help="KV cache budget in bytes").field()
    gpu_memory_utilization: float = Flag(("--gpu-memory-utilization",), type=float, default=0.9).field()
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
    cpu_affinity: str | None = Flag(("--cpu-affinity",), metavar="CPUS",
                                    help="pin the stage (and followers) to these cores, e.g. 0 or 0,1").field()
    source: ModelOptions = group(ModelOptions)
    service: ServiceOptions = group(ServiceOptions)
