"""`stagemesh serve`: the whole mesh on this host as supervised child processes.

One scheduler per data-parallel replica, its pipeline stages (balanced layer
split unless --layer-split), and the router in front. A child that dies is
restarted with backoff (the others go on serving: the router takes a broken
replica out until it is back, stages and schedulers find each other again);
only Ctrl-C or SIGTERM stop the mesh (`--restart-policy never`: the first death
stops it, for debugging). Children die with this process (PR_SET_PDEATHSIG), so
none is orphaned. The children share a generated internal token (in their
environment) unless one is given.
"""
from __future__ import annotations

import argparse
import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

from stagemesh.core import internal_token
from stagemesh.core.errors import StagemeshError
from stagemesh.core.logs import setup_logging
from stagemesh.core.service_options import add_service_arguments, service_argv

log = logging.getLogger("stagemesh.serve")

# OpenMP workers of a CPU stage spin this many rounds after each parallel region before they sleep
# (libgomp's default, 300,000, is milliseconds on these machines). Stages of one host share its
# cores: a stage that finished its micro-batch would spin on the cores the next stage computes on.
# 20,000 still bridges the gaps between the ops of one step. Measured at batch 1, PP=2, 2 threads
# per stage on 2 cores (benchmarks/profile_mesh_step.py --threads 2): 44-45 ms per token against
# 58-64 ms with the default. A GOMP_SPINCOUNT or OMP_WAIT_POLICY of the user's is left alone.
CPU_STAGE_SPIN_COUNT = "20000"
RESTART_BACKOFF_S = (1.0, 30.0)  # first and longest wait before a dead child starts again (exit code 2, a
# configuration the child refuses, stops the mesh instead: no restart can fix it)
STABLE_AFTER_S = 60.0  # a child that ran this long restarts after the first wait again


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
    p.add_argument("--enable-auto-tool-choice", action="store_true", help="tool_choice auto (see `stagemesh router`)")
    p.add_argument("--tool-call-parser", choices=("hermes", "llama3_json"), default=None)
    p.add_argument("--responses-store-size", type=int, default=None,
                   help="responses the router keeps for the Responses API (see `stagemesh router`; default 1000)")
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--scheduling-policy", choices=("fcfs", "priority"), default=None,
                   help="the schedulers' policy (see `stagemesh scheduler`; default fcfs)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="schedule a step before the previous one's tokens are back (default: on with GPUs, off on "
                        "CPU; see `stagemesh scheduler`)")
    p.add_argument("--kv-cache-memory", type=int, default=None, help="KV cache bytes per stage")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--enforce-eager", action="store_true", help="stages run decode steps without CUDA graphs")
    p.add_argument("--enable-expert-parallel", action="store_true",
                   help="MoE models: whole experts spread over each stage's TP ranks, or with -dp > 1 over the "
                        "replicas' stages (data-parallel attention; see `stagemesh stage`)")
    p.add_argument("--policy", choices=("least-load", "cache-aware", "round-robin"), default=None,
                   help="the router's balancing over the replicas (default least-load)")
    p.add_argument("--stage-recovery-timeout", type=float, default=None,
                   help="seconds a replica keeps its requests for a failed stage to come back (see `stagemesh "
                        "scheduler`; default 30)")
    p.add_argument("--max-request-retries", type=int, default=None,
                   help="times a request may go on after a failure under it (scheduler and router; default 3)")
    p.add_argument("--threads", type=int, default=0, help="torch threads per stage process (0: cores / processes)")
    p.add_argument("--restart-policy", choices=("on-failure", "never"), default="on-failure",
                   help="on-failure: a child that dies is restarted with backoff while the rest serve; never: "
                        "the first death stops the mesh (debugging)")
    # --metrics-port P: scheduler of replica r on P + r*(PP+1), its stages next, serve's own after them all
    add_service_arguments(p)


@dataclass
class Child:
    name: str
    argv: list[str]
    env: dict[str, str]
    proc: subprocess.Popen | None = None
    started: float = 0.0
    failures: int = 0  # deaths in a row, each within STABLE_AFTER_S of its start
    restart_at: float | None = None  # a dead child's next start
    restarts: int = 0

    def start(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "stagemesh", *self.argv], env=self.env,
                                     preexec_fn=_die_with_parent)
        self.started, self.restart_at = time.monotonic(), None
        log.info("started %s (pid %d): stagemesh %s", self.name, self.proc.pid, " ".join(self.argv))


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
    from stagemesh.core.model_config import layer_ranges, layer_split, parse_layer_split

    pp, tp, dp = args.pipeline_parallel_size, args.tensor_parallel_size, args.data_parallel_size
    split = (parse_layer_split(args.layer_split, num_layers, pp) if args.layer_split else layer_split(num_layers, pp))
    processes = dp * pp * tp
    threads = args.threads or max(1, (os.cpu_count() or 1) // processes)
    device = "cuda" if cuda else "cpu"
    common_sched = _flags(args, ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "block_size",
                                 "served_model_name", "stage_recovery_timeout", "max_request_retries",
                                 "scheduling_policy"))
    if not args.enable_prefix_caching:
        common_sched.append("--no-enable-prefix-caching")
    if args.async_scheduling is not None:
        common_sched.append("--async-scheduling" if args.async_scheduling else "--no-async-scheduling")
    children, replicas, gpu = [], [], 0
    ep_port = free_port() if args.enable_expert_parallel and dp > 1 else None  # replica 0's stage hosts the store
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
                    *(["--data-parallel-size", str(dp), "--data-parallel-rank", str(r), "--data-parallel-address",
                       "127.0.0.1", "--data-parallel-rpc-port", str(ep_port)] if ep_port else []),
                    *_flags(args, ("dtype", "block_size", "kv_cache_memory", "gpu_memory_utilization"))]
            children.append((f"stage[{r}.{i}]", argv, env))
    router = ["router", model_dir, "--host", args.host, "--port", str(args.port), *_service(args, None)]
    for replica in replicas:
        router += ["--replica", replica]
    router += ["--enable-auto-tool-choice"] if args.enable_auto_tool_choice else []
    children.append(("router", router + _flags(args, ("grpc_port", "served_model_name", "api_key", "max_model_len",
                                                      "tool_call_parser", "max_request_retries", "policy",
                                                      "responses_store_size")), {}))
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
    from stagemesh.core.default_model import resolve_model
    from stagemesh.core.model_config import ModelConfig

    setup_logging(args.log_level, args.log_format)
    model_dir = resolve_model(args.model)
    cfg = ModelConfig.from_path(model_dir)
    cfg.check_tp_size(args.tensor_parallel_size)
    cuda = args.device == "cuda" or (args.device is None and _cuda_available())
    if args.enable_expert_parallel:
        _check_expert_parallel(cfg, args, cuda)
    token = internal_token.configure(args) or internal_token.new_token()
    base_env = {**os.environ, internal_token.ENV: token}
    children = [Child(name, argv, {**base_env, **env})
                for name, argv, env in plan_commands(args, str(model_dir), cfg.num_hidden_layers, cuda)]
    metrics = _serve_metrics(args, args.data_parallel_size * (args.pipeline_parallel_size + 1))
    stop = {"signal": None}
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _: stop.update(signal=signum))
    try:
        for child in children:
            child.start()
        return _supervise(children, stop, args.restart_policy, metrics)
    finally:
        _stop_all(children)


def _serve_metrics(args: argparse.Namespace, offset: int):
    """serve's own Prometheus metrics (children up, restarts), on the port after its children's."""
    from prometheus_client import Counter, Gauge, start_http_server

    up = Gauge("stagemesh:serve_child_up", "1 while the child process runs", ["child"])
    restarts = Counter("stagemesh:serve_child_restarts", "Times a dead child was started again", ["child"])
    if args.metrics_port is not None:
        start_http_server(args.metrics_port + offset, addr="127.0.0.1")
        log.info("serve's metrics (child restarts) on port %d at /metrics", args.metrics_port + offset)
    return up, restarts


def _supervise(children: list[Child], stop: dict, policy: str, metrics) -> int:
    up, restarts = metrics
    while stop["signal"] is None:
        now = time.monotonic()
        for child in children:
            code = child.proc.poll() if child.proc is not None else None
            if code is not None:
                child.proc = None
                if policy == "never":
                    log.error("%s exited with code %d; stopping the mesh (--restart-policy never)", child.name, code)
                    return 1
                if code == 2:  # a bad flag, model or port: starting it again cannot help
                    log.error("%s exited with code 2 (its configuration is refused: see its error above); "
                              "stopping the mesh", child.name)
                    return 1
                child.failures = 1 if now - child.started > STABLE_AFTER_S else child.failures + 1
                wait = min(RESTART_BACKOFF_S[0] * 2 ** (child.failures - 1), RESTART_BACKOFF_S[1])
                child.restart_at = now + wait
                log.error("%s exited with code %d; restarting it in %.0fs (the rest keep serving)", child.name, code,
                          wait)
            elif child.proc is None and child.restart_at is not None and now >= child.restart_at:
                child.start()
                child.restarts += 1
                restarts.labels(child.name).inc()
            up.labels(child.name).set(1 if child.proc is not None else 0)
        time.sleep(0.2)
    log.info("signal %d: stopping every child", stop["signal"])
    return 0


def _stop_all(children: list[Child]) -> None:
    running = [c for c in children if c.proc is not None and c.proc.poll() is None]
    for child in reversed(running):
        child.proc.terminate()
    deadline = time.monotonic() + 15
    for child in running:
        try:
            child.proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            log.warning("%s did not stop in time: killing it", child.name)
            child.proc.kill()
            child.proc.wait()


def _check_expert_parallel(cfg, args: argparse.Namespace, cuda: bool) -> None:
    tp, pp, dp = args.tensor_parallel_size, args.pipeline_parallel_size, args.data_parallel_size
    if dp == 1:  # experts over each stage's TP ranks
        cfg.check_expert_parallel(tp)
        return
    # vLLM's meaning of the pair: data-parallel attention, the experts spread over the replicas (stage_worker.ep_group)
    cfg.check_expert_parallel(dp, across_replicas=True)
    not_built = [what for what, bad in ((f"-tp {tp}", tp != 1), (f"-pp {pp}", pp != 1), ("CUDA stages", cuda)) if bad]
    if not_built:
        raise StagemeshError("--enable-expert-parallel with --data-parallel-size > 1 (experts across the replicas) is "
                             "built for -tp 1 -pp 1 CPU stages only; not yet with " + ", ".join(not_built))


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        raise StagemeshError("torch is not installed: run `make install`") from None
