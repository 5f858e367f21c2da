"""`stagemesh plan MODEL_OR_CONFIG --gpus-per-node N --nodes M --gpu-memory 80GiB ...`."""
from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from stagemesh.core.common_flags import KV_CACHE_DTYPE
from stagemesh.core.errors import StagemeshError
from stagemesh.core.kv_cache_dtype import check_attention

REFERENCE = Path(__file__).with_name("reference_configs")
UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "kib": 2**10, "mib": 2**20, "gib": 2**30,
         "tib": 2**40}


def add_arguments(p: argparse.ArgumentParser) -> None:
    names = ", ".join(sorted(f.stem for f in REFERENCE.glob("*.json")))
    p.add_argument("model", help=f"a model directory, a config.json, or a reference config: {names}")
    p.add_argument("--gpus-per-node", type=int, default=1)
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--gpu-memory", default="80GiB", help="memory of one GPU (or, with --device cpu, of one process)")
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32", "fp8", "int4", "q4_0", "q4_1", "q4_k", "q8_0", "int8",
                                       "mxfp4"),
                   default=None, help="the weights' format: q4_0 / q4_1 / q4_k / q8_0 (--quantization gguf), int8 "
                                      "(w8a16 / w8a8) and fp8 (--quantization fp8) count their scales as a stage "
                                      "holds them (a block-FP8 checkpoint's per block); int4: GPTQ / AWQ / W4A16 "
                                      "checkpoints; mxfp4: gpt-oss's MXFP4 experts, the rest bf16 (default: a "
                                      "quantised checkpoint's own format, read from its quantization_config; else "
                                      "bf16)")
    p.add_argument("--max-model-len", type=int, default=None, help="default: the model's, at most 32768")
    KV_CACHE_DTYPE.add_to(p, "kv_cache_dtype")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--no-nvlink", action="store_true", help="GPUs talk over PCIe: prefer pipeline parallelism")
    p.add_argument("--target-concurrency", type=float, default=None, help="requests at max-model-len to hold at once")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=None, help="evaluate this TP size")
    p.add_argument("--pipeline-parallel-size", "-pp", type=int, default=None, help="evaluate this PP size")
    p.add_argument("--decode-context-parallel-size", "-dcp", type=int, default=None,
                   help="evaluate this DCP size with -tp: each sequence's KV split over this many TP ranks (it "
                        "divides -tp and the block size 16); without it the plan proposes DCP where TP replicates "
                        "the KV heads and the KV of --max-model-len does not fit otherwise (-dcp 1: never)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="the device the printed commands use")
    p.add_argument("--distributed-executor-backend", choices=("mp", "ray"), default="mp",
                   help="the commands to print: services started by hand on each node (mp), or `ray start` on "
                        "each node and one `stagemesh serve --distributed-executor-backend ray`, with where Ray "
                        "puts each service")
    p.add_argument("--json", action="store_true", help="print the plan as a JSON object")


def parse_bytes(text: str) -> int:
    match = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in UNITS:
        raise StagemeshError(f"--gpu-memory {text!r} must be a size like 80GiB, 80GB or 24e9")
    return int(float(match.group(1)) * UNITS[match.group(2).lower()])


def load_config(model: str):
    from stagemesh.core.model_config import ModelConfig

    reference = REFERENCE / f"{model}.json"
    if reference.is_file():
        return ModelConfig.from_path(reference), f"<path to {model}>"
    return ModelConfig.from_path(model), model


def weights_dtype(cfg, dtype: str | None) -> str:
    """The weights' format to plan: a quantised checkpoint's own (a different --dtype is refused), else --dtype."""
    from stage_worker.quant_methods import checkpoint_method

    method = checkpoint_method(cfg, None)
    if method is None:
        return dtype or "bf16"
    if dtype is not None and dtype != method.plan_dtype:
        raise StagemeshError(f"the checkpoint is stored as {method.plan_dtype} ({method.name}); --dtype {dtype} "
                             "would plan other weights than it holds")
    return method.plan_dtype


def run(args: argparse.Namespace) -> int:
    from stagemesh.entry.plan.render import as_json, as_text
    from stagemesh.entry.plan.tree import PlanRequest, make_plan

    cfg, model = load_config(args.model)
    if args.gpus_per_node < 1 or args.nodes < 1:
        raise StagemeshError("--gpus-per-node and --nodes must be >= 1")
    if not 0 < args.gpu_memory_utilization <= 1:
        raise StagemeshError("--gpu-memory-utilization must be in (0, 1]")
    max_len = args.max_model_len or min(cfg.max_position_embeddings, 32768)
    dtype = weights_dtype(cfg, args.dtype)
    check_attention(args.kv_cache_dtype, cfg)
    req = PlanRequest(cfg, args.gpus_per_node, args.nodes, parse_bytes(args.gpu_memory), dtype, max_len,
                      args.gpu_memory_utilization, not args.no_nvlink, args.target_concurrency,
                      args.tensor_parallel_size, args.pipeline_parallel_size, args.decode_context_parallel_size,
                      args.kv_cache_dtype)
    plan = make_plan(req)
    backend = args.distributed_executor_backend
    print(json.dumps(as_json(req, plan, model, args.device, backend), indent=2) if args.json
          else as_text(req, plan, model, args.device, backend))
    return 0
