"""`stagemesh serve`: the whole mesh as supervised services, on this host or on a Ray cluster.

One scheduler per data-parallel replica, its pipeline stages (balanced layer
split unless --layer-split), and the router in front. With the mp backend
(default) every service is a child process of this one; with
`--distributed-executor-backend ray` each runs under a Ray actor somewhere on
the cluster this node belongs to (stagemesh.entry.ray_executor). Either way a service
that dies is restarted with backoff (stagemesh.entry.supervisor) while the others go
on serving: the router takes a broken replica out until it is back, stages and
schedulers find each other again. Only Ctrl-C or SIGTERM stop the mesh, which
drains first (stagemesh.entry.local_mesh; `--restart-policy never`: the first death
stops it, for debugging). The
services share a generated internal token (in their environment) unless one is
given. On either backend an admin API (stagemesh.entry.ops) restarts every service one
at a time (`stagemesh rollout`) and adds or removes replicas while the mesh serves
(`stagemesh scale`, or the autoscaler: --autoscale-max-replicas).
"""
from __future__ import annotations

import argparse
import logging
import json
import os
import shutil
import signal
import threading

from stagemesh.core import internal_token
from stagemesh.core.errors import StagemeshError
from stagemesh.core.logs import setup_logging
from stagemesh.core.flags import add_flags
from stagemesh.core.service_options import configure_tls
from stagemesh.entry import forkserver
from stagemesh.entry.layout import Addresses, ChildSpec, MeshLayout, cpu_stage_env, free_port, plan_commands  # noqa: F401
from stagemesh.entry.ray_actor import NODE_IP
from stagemesh.entry.local_mesh import Signals
from stagemesh.entry.ops import mesh as ops_mesh, serve_ops
from stagemesh.entry.serve_options import RAY_STAGE_RECOVERY_TIMEOUT_S, ServeOptions

log = logging.getLogger("stagemesh.serve")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_flags(p, ServeOptions)


def run(args: argparse.Namespace) -> int:
    setup_logging(args.log_level, args.log_format)
    signals = Signals().install()  # a signal during start-up: nothing more starts, and serve exits 0
    _check_layout(args)
    forkserver.method()  # a start method it does not know is refused before any child starts
    autoscale = serve_ops.autoscale_config(args)
    token = internal_token.configure(args) or internal_token.new_token()
    configure_tls(args.tls_cert, args.tls_key, args.tls_ca)  # (serve's own calls to its children)
    if args.distributed_executor_backend == "ray":
        return _run_on_ray(args, token, signals, autoscale)
    source, cfg = _model(args)
    cuda = args.device == "cuda" or (args.device is None and _cuda_available())
    _check_expert_parallel(cfg, args, cuda)
    _check_quantization(source, cfg, cuda)
    base_env = {**os.environ, internal_token.ENV: token}
    layout = MeshLayout.build(args, str(source.model_dir), cfg.num_hidden_layers, cuda,
                              stage_model=source.stage_args(), control=True)
    if layout.cpu is not None and not cuda:
        log.info("%s", layout.cpu.describe())
    metrics = _serve_metrics(args, args.data_parallel_size * (args.pipeline_parallel_size + 1))
    return _operate(args, ops_mesh.build(args, layout, base_env, signals, metrics, token), autoscale)


def _operate(args: argparse.Namespace, mesh, autoscale) -> int:
    """Run a built mesh (mp or Ray) with its admin API (and autoscaler) beside it until it stops."""
    controller = serve_ops.controller_for(mesh, autoscale)
    admin = serve_ops.Admin(args, controller)
    _reload_api_keys_on_sighup(args, controller)
    try:
        return mesh.host.run()
    finally:
        admin.close()
        mesh.rpc.close()
        shutil.rmtree(mesh.layout.metrics_dir, ignore_errors=True)  # the routers' shared metrics


def _reload_api_keys_on_sighup(args: argparse.Namespace, controller) -> None:
    """SIGHUP to serve: every router reads its --api-keys-file again (on a thread: a signal handler must not
    wait for the routers)."""
    if args.api_keys_file:
        signal.signal(signal.SIGHUP, lambda *_: threading.Thread(target=controller.reload_api_keys, daemon=True,
                                                                  name="reload-api-keys").start())


def _run_on_ray(args: argparse.Namespace, token: str, signals: Signals, autoscale) -> int:
    from stagemesh.entry import ray_mesh
    from stagemesh.entry.ray_executor import RayCluster, Stopped

    try:  # refuses clearly when no cluster answers
        cluster = RayCluster.connect(stopping=lambda: signals.count > 0)
    except Stopped:
        return 0
    signals.install()  # (ray.init put its own SIGTERM handler in place: it ends the process at once)
    if signals.count:  # told to stop during ray.init
        cluster.shutdown()
        return 0
    try:
        source, cfg = _model(args)
        cuda = args.device == "cuda" or (args.device is None and cluster.has_gpus())
        _check_expert_parallel(cfg, args, cuda, ray=True)
        if source.quantization:
            raise StagemeshError(f"--quantization {source.quantization} is not built for --distributed-executor-"
                                 "backend ray yet (a node would need the file at the same path): use mp")
        if args.stage_recovery_timeout is None:
            args.stage_recovery_timeout = RAY_STAGE_RECOVERY_TIMEOUT_S
        # the default model: every node converts (or finds) its own copy, as the services on one host do
        model = None if args.model is None else str(source.model_dir)
        layout = MeshLayout.build(args, model, cfg.num_hidden_layers, cuda, Addresses(cluster.head_ip, NODE_IP),
                                  control=True)
        metrics = _serve_metrics(args, args.data_parallel_size * (args.pipeline_parallel_size + 1))
        return _operate(args, ray_mesh.build(args, layout, cluster, {internal_token.ENV: token}, signals, metrics,
                                             token), autoscale)
    finally:
        cluster.shutdown()


def _check_lora(args: argparse.Namespace) -> None:
    """The LoRA flags and every adapter's config, checked before anything starts (the stages read the weights);
    adapter paths made absolute for the services."""
    from stagemesh.core.lora import lora_from_args, read_adapter_config

    lora = lora_from_args(args)
    if lora is None:
        return
    if args.speculative_config:
        raise StagemeshError("--enable-lora with --speculative-config is not supported yet")
    for m in lora[1]:
        read_adapter_config(m.name, m.path, lora[0].max_lora_rank)
    args.lora_modules = [json.dumps({"name": m.name, "path": os.path.abspath(m.path),
                                     "base_model_name": m.base_model_name}) for m in lora[1]]


def _check_layout(args: argparse.Namespace) -> None:
    from scheduler.cli import kv_tier_bytes

    kv_tier_bytes(args)  # (the schedulers check them again: refused here before anything starts)
    _check_lora(args)
    if args.api_server_count < 1:
        raise StagemeshError(f"--api-server-count must be >= 1 (got {args.api_server_count})")
    _check_api_keys(args)
    if args.api_server_count > 1:  # several routers share fixed ports: "any free port" must be chosen here
        args.port = args.port or free_port(args.host)
        args.grpc_port = args.grpc_port or free_port(args.host) if args.grpc_port is not None else None
    from router.responses_api.store import MEMORY
    from router.responses_api.store_flags import check_store_options

    try:  # refused here rather than by a router child restarted over and over
        check_store_options(args.responses_store or MEMORY, args.responses_store_size, args.responses_store_ttl)
    except ValueError as err:
        raise StagemeshError(str(err)) from None
    from scheduler.cli import check_kv_load_arguments

    check_kv_load_arguments(args)
    if args.prefill_replicas and not 0 < args.prefill_replicas < args.data_parallel_size:
        raise StagemeshError(f"--prefill-replicas {args.prefill_replicas} needs a decode replica too: give a "
                             f"--data-parallel-size above it (now {args.data_parallel_size})")


def _check_api_keys(args: argparse.Namespace) -> None:
    """--api-keys-file refused here, naming the line, rather than by router children restarted over and over;
    made absolute for them."""
    if not args.api_keys_file:
        return
    from router.tenants import Tenants

    if args.api_key:
        raise StagemeshError("--api-key and --api-keys-file cannot both be given: add the key to a tenant of the file")
    Tenants.from_file(args.api_keys_file)
    args.api_keys_file = os.path.abspath(os.path.expanduser(args.api_keys_file))


def _model(args: argparse.Namespace):
    """The model source (stagemesh.core.model_source) and its config; the schedulers and the router are told
    the source's served name."""
    from stagemesh.core.model_config import ModelConfig
    from stagemesh.core.model_source import resolve_source

    source = resolve_source(args.model, args.tokenizer, args.quantization, args.quantization_activations)
    cfg = ModelConfig.from_path(source.model_dir)
    cfg.check_tp_size(args.tensor_parallel_size)
    cfg.check_decode_context_parallel(args.tensor_parallel_size, args.decode_context_parallel_size, args.block_size)
    cfg.check_prefill_context_parallel(args.prefill_context_parallel_size, args.block_size,
                                       args.decode_context_parallel_size)
    if args.served_model_name is None and source.gguf_file is not None:
        args.served_model_name = source.name
    _check_generation_config(args, source.model_dir)
    return source, cfg


def _check_generation_config(args: argparse.Namespace, model_dir) -> None:
    """The routers' sampling defaults, refused here rather than by a router child restarted over and over; a
    FOLDER made absolute for the children."""
    from router.generation_config import MODES, load

    load(model_dir, args.generation_config, args.override_generation_config)
    if args.generation_config not in MODES:
        args.generation_config = os.path.abspath(os.path.expanduser(args.generation_config))


def _check_quantization(source, cfg, cuda: bool) -> None:
    """What the stages would refuse, refused before any starts."""
    from stage_worker.quantization import check_quantization

    method = check_quantization(source.quantization, cfg, "cuda" if cuda else "cpu")
    from stage_worker.activations import check_allowed

    check_allowed(source.activations, source.quantization or (method.name if method is not None else None))


def _serve_metrics(args: argparse.Namespace, offset: int):
    """serve's own Prometheus metrics (children up, restarts), on the port after its children's."""
    from prometheus_client import Counter, Gauge, start_http_server

    up = Gauge("stagemesh:serve_child_up", "1 while the child process runs", ["child"])
    restarts = Counter("stagemesh:serve_child_restarts", "Times a dead child was started again", ["child"])
    if args.metrics_port is not None:
        start_http_server(args.metrics_port + offset, addr="127.0.0.1")
        log.info("serve's metrics (child restarts) on port %d at /metrics", args.metrics_port + offset)
    return up, restarts


def _check_expert_parallel(cfg, args: argparse.Namespace, cuda: bool, ray: bool = False) -> None:
    tp, pp, dp = args.tensor_parallel_size, args.pipeline_parallel_size, args.data_parallel_size
    if not args.enable_expert_parallel:
        return
    if dp == 1:  # experts over each stage's TP ranks
        cfg.check_expert_parallel(tp)
        return
    if ray:  # the group's store lives on replica 0's stage, whose node only Ray knows
        raise StagemeshError("--enable-expert-parallel with --data-parallel-size > 1 (experts across the replicas) "
                             "is not built for --distributed-executor-backend ray yet: use mp")
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
