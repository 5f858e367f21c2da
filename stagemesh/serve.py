"""`stagemesh serve`: the whole mesh on this host as supervised child processes.

One scheduler per data-parallel replica, its pipeline stages (balanced layer
split unless --layer-split), and the router in front when it is built. Ctrl-C
or SIGTERM stops every child; a child that dies is reported and the rest are
stopped; children die with this process (PR_SET_PDEATHSIG), so none is orphaned.
"""
from __future__ import annotations

import argparse
import ctypes
import importlib.util
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

from stagemesh.errors import StagemeshError
from stagemesh.logs import setup_logging
from stagemesh.service_options import add_service_arguments, service_argv

log = logging.getLogger("stagemesh.serve")

# OpenMP workers of a CPU stage spin this many rounds after each parallel region before they sleep
# (libgomp's default, 300,000, is milliseconds on these machines). Stages of one host share its
# cores: a stage that finished its micro-batch would spin on the cores the next stage computes on.
# 20,000 still bridges the gaps between the ops of one step. Measured at batch 1, PP=2, 2 threads
# per stage on 2 cores (benchmarks/profile_mesh_step.py --threads 2): 44-45 ms per token against
# 58-64 ms with the default. A GOMP_SPINCOUNT or OMP_WAIT_POLICY of the user's is left alone.
CPU_STAGE_SPIN_COUNT = "20000"


def cpu_stage_env() -> dict[str, str]:
    """What a CPU stage process of this host gets added to its environment."""
    if {"GOMP_SPINCOUNT", "OMP_WAIT_POLICY"} & os.environ.keys():
        return {}
    return {"GOMP_SPINCOUNT": CPU_STAGE_SPIN_COUNT}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None, help="model directory (default: the embedded model)")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    p.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1)
    p.add_argument("--data-parallel-size", "-dp", type=int, default=1)
    p.add_argument("--layer-split", default=None, help="layers per stage, e.g. 10,12,8 (default: balanced)")
    p.add_argument("--handoff", choices=("nccl", "grpc"), default="nccl")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda when available")
    p.add_argument("--dtype", default=None)
    p.add_argument("--host", default="127.0.0.1", help="the router's HTTP address")
    p.add_argument("--port", type=int, default=8000, help="the router's HTTP port")
    p.add_argument("--grpc-port", type=int, default=50050, help="the router's gRPC frontend port")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--api-key", default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="schedule a step before the previous one's tokens are back (default: on with GPUs, off on "
                        "CPU; see `stagemesh scheduler`)")
    p.add_argument("--kv-cache-memory", type=int, default=None, help="KV cache bytes per stage")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--enforce-eager", action="store_true", help="stages run decode steps without CUDA graphs")
    p.add_argument("--enable-expert-parallel", action="store_true",
                   help="MoE models: whole experts spread over each stage's TP ranks (see `stagemesh stage`)")
    p.add_argument("--threads", type=int, default=0, help="torch threads per stage process (0: cores / processes)")
    add_service_arguments(p)  # --metrics-port P: scheduler of replica r on P + r*(PP+1), its stages next


@dataclass
class Child:
    name: str
    proc: subprocess.Popen


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def plan_commands(args: argparse.Namespace, model_dir: str, num_layers: int, cuda: bool) -> list[tuple[str, list[str], dict]]:
    """(name, argv, extra env) of every child, schedulers before their stages, the router last."""
    from stagemesh.model_config import layer_ranges, layer_split, parse_layer_split

    pp, tp, dp = args.pipeline_parallel_size, args.tensor_parallel_size, args.data_parallel_size
    split = (parse_layer_split(args.layer_split, num_layers, pp) if args.layer_split else layer_split(num_layers, pp))
    processes = dp * pp * tp
    threads = args.threads or max(1, (os.cpu_count() or 1) // processes)
    device = "cuda" if cuda else "cpu"
    common_sched = _flags(args, ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "block_size",
                                 "served_model_name"))
    if not args.enable_prefix_caching:
        common_sched.append("--no-enable-prefix-caching")
    if args.async_scheduling is not None:
        common_sched.append("--async-scheduling" if args.async_scheduling else "--no-async-scheduling")
    children, replicas, gpu = [], [], 0
    for r in range(dp):
        port = free_port()
        replicas.append(f"127.0.0.1:{port}")
        children.append((f"scheduler[{r}]", ["scheduler", model_dir, "--port", str(port), "--pipeline-parallel-size",
                                              str(pp), *common_sched, *_service(args, r * (pp + 1))], {}))
        for i, (a, b) in enumerate(layer_ranges(split)):
            if cuda:
                env = {"CUDA_VISIBLE_DEVICES": ",".join(str(gpu + t) for t in range(tp))}
                gpu += tp
            else:
                env = cpu_stage_env()
            argv = ["stage", model_dir, "--scheduler", replicas[-1], "--stage-index", str(i), "--layers", f"{a}:{b}",
                    "--tensor-parallel-size", str(tp), "--handoff", args.handoff, "--device", device,
                    "--threads", str(threads), *_service(args, r * (pp + 1) + 1 + i),
                    *(["--enforce-eager"] if args.enforce_eager else []),
                    *(["--enable-expert-parallel"] if args.enable_expert_parallel else []),
                    *_flags(args, ("dtype", "block_size", "kv_cache_memory", "gpu_memory_utilization"))]
            children.append((f"stage[{r}.{i}]", argv, env))
    if importlib.util.find_spec("router.cli") is not None:
        router = ["router", model_dir, "--host", args.host, "--port", str(args.port), *_service(args, None)]
        for replica in replicas:
            router += ["--replica", replica]
        children.append(("router", router + _flags(args, ("grpc_port", "served_model_name", "api_key",
                                                           "max_model_len")), {}))
    return children


def _service(args: argparse.Namespace, metrics_offset: int | None) -> list[str]:
    """Logs, traces, TLS for a child; a metrics port when --metrics-port is given (not for the router,
    whose metrics are on its HTTP port)."""
    argv = service_argv(args)
    if metrics_offset is not None and args.metrics_port is not None:
        argv += ["--metrics-port", str(args.metrics_port + metrics_offset)]
    return argv


def _flags(args: argparse.Namespace, names: tuple[str, ...]) -> list[str]:
    out = []
    for name in names:
        value = getattr(args, name)
        if value is not None:
            out += [f"--{name.replace('_', '-')}", str(value)]
    return out


def run(args: argparse.Namespace) -> int:
    from stagemesh.default_model import resolve_model
    from stagemesh.model_config import ModelConfig

    setup_logging(args.log_level, args.log_format)
    model_dir = resolve_model(args.model)
    cfg = ModelConfig.from_path(model_dir)
    cfg.check_tp_size(args.tensor_parallel_size)
    if args.enable_expert_parallel:
        _check_expert_parallel(cfg, args.tensor_parallel_size, args.data_parallel_size)
    cuda = args.device == "cuda" or (args.device is None and _cuda_available())
    commands = plan_commands(args, str(model_dir), cfg.num_hidden_layers, cuda)
    children: list[Child] = []
    stop = {"signal": None}
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _: stop.update(signal=signum))
    try:
        for name, argv, env in commands:
            proc = subprocess.Popen([sys.executable, "-m", "stagemesh", *argv], env={**os.environ, **env},
                                    preexec_fn=_die_with_parent)
            children.append(Child(name, proc))
            log.info("started %s (pid %d): stagemesh %s", name, proc.pid, " ".join(argv))
        if not any(c.name == "router" for c in children):
            log.warning("the router (HTTP gateway) is not built yet: talk to the schedulers over gRPC "
                        "(stagemesh.v1.Scheduler) at %s",
                        ", ".join(f"127.0.0.1:{argv[3]}" for name, argv, _ in commands if name.startswith("sched")))
        return _supervise(children, stop)
    finally:
        _stop_all(children)


def _supervise(children: list[Child], stop: dict) -> int:
    while stop["signal"] is None:
        for child in children:
            code = child.proc.poll()
            if code is not None:
                log.error("%s (pid %d) exited with code %d; stopping the mesh", child.name, child.proc.pid, code)
                return 1
        time.sleep(0.2)
    log.info("signal %d: stopping every child", stop["signal"])
    return 0


def _stop_all(children: list[Child]) -> None:
    for child in reversed(children):
        if child.proc.poll() is None:
            child.proc.terminate()
    deadline = time.monotonic() + 15
    for child in children:
        try:
            child.proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            log.warning("%s did not stop in time: killing it", child.name)
            child.proc.kill()
            child.proc.wait()


def _check_expert_parallel(cfg, tp_size: int, dp_size: int) -> None:
    if dp_size > 1:  # vLLM's meaning of the pair: data-parallel attention, one EP group across the replicas
        raise StagemeshError("--enable-expert-parallel with --data-parallel-size > 1 is not supported yet: expert "
                             "parallelism spans one stage's TP ranks for now, not the replicas (data-parallel "
                             "attention with experts across replicas is not built); use one of the two")
    cfg.check_expert_parallel(tp_size)


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        raise StagemeshError("torch is not installed: run `make install`") from None
