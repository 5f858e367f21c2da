"""`stagemesh serve`: the whole mesh as supervised services, on this host or on a Ray cluster.

One scheduler per data-parallel replica, its pipeline stages (balanced layer
split unless --layer-split), and the router in front. With the mp backend
(default) every service is a child process of this one; with
`--distributed-executor-backend ray` each runs under a Ray actor somewhere on
the cluster this node belongs to (stagemesh.ray_executor). Either way a service
that dies is restarted with backoff (stagemesh.supervisor) while the others go
on serving: the router takes a broken replica out until it is back, stages and
schedulers find each other again. Only Ctrl-C or SIGTERM stop the mesh, which
drains first (stagemesh.local_mesh; `--restart-policy never`: the first death
stops it, for debugging). The
services share a generated internal token (in their environment) unless one is
given. On either backend an admin API (stagemesh.ops) restarts every service one
at a time (`stagemesh rollout`) and adds or removes replicas while the mesh serves
(`stagemesh scale`, or the autoscaler: --autoscale-max-replicas).
"""
from __future__ import annotations

import argparse
import logging
import json
import os

from stagemesh.core import internal_token
from stagemesh.core.errors import StagemeshError
from stagemesh.core.logs import setup_logging
from stagemesh.core.service_options import add_service_arguments, configure_tls
from stagemesh.layout import Addresses, ChildSpec, MeshLayout, cpu_stage_env, free_port, plan_commands  # noqa: F401
from stagemesh.ray_actor import NODE_IP
from stagemesh.local_mesh import Signals
from stagemesh.ops import mesh as ops_mesh, serve_ops

log = logging.getLogger("stagemesh.serve")

# On Ray a stage may be lost with its node: Ray declares a node dead after missing its health checks (about
# 15 s by default), then places the stage elsewhere and it loads its weights; 30 s would not cover that.
RAY_STAGE_RECOVERY_TIMEOUT_S = 90.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None,
                   help="model directory, or a .gguf file with --tokenizer (default: the embedded model)")
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
    p.add_argument("--api-server-count", "-asc", type=int, default=1, metavar="N",
                   help="routers (vLLM's API servers) over the replicas, sharing the HTTP and gRPC ports "
                        "(SO_REUSEPORT: the kernel spreads connections over them); one that dies or is upgraded "
                        "loses no stream a client resumes (Last-Event-ID; stagemesh.client does it by itself)")
    p.add_argument("--resume-grace-period", type=float, default=None, metavar="SECONDS",
                   help="a stream whose router went away keeps running this long for a client to resume it on "
                        "another router (see `stagemesh scheduler`; default 30)")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--api-key", default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--enable-auto-tool-choice", action=argparse.BooleanOptionalAction, default=None,
                   help="tool_choice \"auto\" (default: on when the model's chat template shows a tool-call format "
                        "a parser reads; see `stagemesh router`)")
    p.add_argument("--tool-call-parser", choices=("hermes", "llama3_json"), default=None,
                   help="hermes or llama3_json (default: chosen from the chat template)")
    p.add_argument("--responses-store", default=None, metavar="memory|URL",
                   help="where the router keeps the Responses API's responses: memory (default) or a Redis URL "
                        "(redis://HOST:PORT/DB, rediss://, unix://) that routers of other hosts may share (see "
                        "`stagemesh router`)")
    p.add_argument("--responses-store-size", type=int, default=None,
                   help="responses the memory store keeps (see `stagemesh router`; default 1000)")
    p.add_argument("--responses-store-ttl", type=float, default=None, metavar="SECONDS",
                   help="seconds a Redis store keeps each response (see `stagemesh router`; default 3600)")
    p.add_argument("--trust-request-chat-template", action="store_true",
                   help="the router renders a request's own chat_template instead of refusing it (see `stagemesh "
                        "router`)")
    p.add_argument("--chat-template-timeout", type=float, default=None, metavar="SECONDS",
                   help="the time a request's own chat template may take to render (see `stagemesh router`; "
                        "default 5)")
    p.add_argument("--structured-outputs-config", default=None, metavar="JSON",
                   help="JSON constraints' whitespace: {\"disable_any_whitespace\": false} lets them indent (see "
                        "`stagemesh router`; default compact)")
    p.add_argument("--grammar-compile-timeout", type=float, default=None, metavar="SECONDS",
                   help="the time a request's constraint may take to compile (see `stagemesh router`; default 5)")
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--scheduling-policy", choices=("fcfs", "priority"), default=None,
                   help="the schedulers' policy (see `stagemesh scheduler`; default fcfs)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="schedule a step before the previous one's tokens are back (default: on with GPUs, off on "
                        "CPU; see `stagemesh scheduler`)")
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help="vLLM's speculative decoding config: {\"method\": \"ngram\", \"num_speculative_tokens\": k, "
                        "\"prompt_lookup_max\": 4, \"prompt_lookup_min\": 2} (prompt lookup, in the schedulers) or "
                        "{\"model\": DIR, \"num_speculative_tokens\": k} (a draft model on each replica's last "
                        "stage); not with --async-scheduling (docs/speculative-decoding.md)")
    p.add_argument("--kv-cache-memory", type=int, default=None, help="KV cache bytes per stage")
    from scheduler.cli import add_kv_tier_arguments

    add_kv_tier_arguments(p)  # the schedulers' (the stages get --kv-offloading-disk-path)
    from stagemesh.core.lora import add_lora_arguments

    add_lora_arguments(p)  # every service's: the stages load the adapters, schedulers and routers know their names
    p.add_argument("--kv-offloading-disk-path", default=None, metavar="DIR",
                   help="the disk tier of the stages' KV (docs/kv-tiers.md; see `stagemesh stage`): replica i's "
                        "stages keep their blocks under DIR/replica-<i>, so replicas never share a directory; kept "
                        "across restarts, so a restarted replica serves its prefixes from disk at once")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--enforce-eager", action="store_true", help="stages run decode steps without CUDA graphs")
    p.add_argument("--enable-expert-parallel", action="store_true",
                   help="MoE models: whole experts spread over each stage's TP ranks, or with -dp > 1 over the "
                        "replicas' stages (data-parallel attention; see `stagemesh stage`)")
    p.add_argument("--prefill-replicas", type=int, default=0, metavar="N",
                   help="disaggregated prefill: of the --data-parallel-size replicas, the first N compute new prompts "
                        "(--kv-role prefill) and the others decode (--kv-role decode), fetching the prompts' KV "
                        "(docs/disaggregated-prefill.md); 0: every replica does both")
    from scheduler.cli import add_kv_load_arguments

    add_kv_load_arguments(p)  # --kv-load-failure-policy, --kv-load-timeout: the decode replicas'
    p.add_argument("--enable-eplb", action="store_true",
                   help="MoE models with --enable-expert-parallel: balance the experts' load over each stage's TP "
                        "ranks (see `stagemesh stage`)")
    p.add_argument("--eplb-config", default=None, metavar="JSON", help="vLLM's EPLB settings (see `stagemesh stage`)")
    p.add_argument("--policy", choices=("least-load", "cache-aware", "kv-aware", "round-robin"), default=None,
                   help="the router's balancing over the replicas (default least-load; see `stagemesh router`)")
    p.add_argument("--stage-recovery-timeout", type=float, default=None,
                   help="seconds a replica keeps its requests for a failed stage to come back (see `stagemesh "
                        "scheduler`; default 30)")
    p.add_argument("--max-request-retries", type=int, default=None,
                   help="times a request may go on after a failure under it (scheduler and router; default 3)")
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads per stage process (0: serve's CPU plan: the cores, less one kept for the "
                        "frontend on 8+ cores, over the stage processes; docs/cpu-plan.md)")
    p.add_argument("--restart-policy", choices=("on-failure", "never"), default="on-failure",
                   help="on-failure: a child that dies is restarted with backoff while the rest serve; never: "
                        "the first death stops the mesh (debugging)")
    p.add_argument("--distributed-executor-backend", choices=("mp", "ray"), default="mp",
                   help="mp: every service a child process of this one, on this host; ray: the services run on "
                        "the Ray cluster this node belongs to (`ray start --head` here, `ray start --address` on "
                        "the others, or RAY_ADDRESS): the router and the schedulers on this node, each stage with "
                        "its TP ranks in a placement group of its own wherever Ray finds room, restarted and "
                        "re-placed by Ray when it or its node dies (docs/ray.md). With ray, --threads is the CPUs "
                        "each TP rank asks of Ray (default 1) and --stage-recovery-timeout defaults to "
                        f"{RAY_STAGE_RECOVERY_TIMEOUT_S:.0f}")
    # --metrics-port P: scheduler of replica r on P + r*(PP+1), its stages next, serve's own after them all
    from stagemesh.core.model_source import add_model_arguments

    add_model_arguments(p)
    serve_ops.add_arguments(p)
    add_service_arguments(p)


def run(args: argparse.Namespace) -> int:
    setup_logging(args.log_level, args.log_format)
    signals = Signals().install()  # a signal during start-up: nothing more starts, and serve exits 0
    _check_layout(args)
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
    admin = serve_ops.Admin(args, serve_ops.controller_for(mesh, autoscale))
    try:
        return mesh.host.run()
    finally:
        admin.close()
        mesh.rpc.close()


def _run_on_ray(args: argparse.Namespace, token: str, signals: Signals, autoscale) -> int:
    from stagemesh import ray_mesh
    from stagemesh.ray_executor import RayCluster, Stopped

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
    if args.api_server_count > 1:  # several routers share fixed ports: "any free port" must be chosen here
        args.port = args.port or free_port(args.host)
        args.grpc_port = args.grpc_port or free_port(args.host) if args.grpc_port is not None else None
    from router.responses_api.store import MEMORY, check_store_options

    try:  # refused here rather than by a router child restarted over and over
        check_store_options(args.responses_store or MEMORY, args.responses_store_size, args.responses_store_ttl)
    except ValueError as err:
        raise StagemeshError(str(err)) from None
    from scheduler.cli import check_kv_load_arguments

    check_kv_load_arguments(args)
    if args.prefill_replicas and not 0 < args.prefill_replicas < args.data_parallel_size:
        raise StagemeshError(f"--prefill-replicas {args.prefill_replicas} needs a decode replica too: give a "
                             f"--data-parallel-size above it (now {args.data_parallel_size})")


def _model(args: argparse.Namespace):
    """The model source (stagemesh.core.model_source) and its config; the schedulers and the router are told
    the source's served name."""
    from stagemesh.core.model_config import ModelConfig
    from stagemesh.core.model_source import resolve_source

    source = resolve_source(args.model, args.tokenizer, args.quantization)
    cfg = ModelConfig.from_path(source.model_dir)
    cfg.check_tp_size(args.tensor_parallel_size)
    if args.served_model_name is None and source.gguf_file is not None:
        args.served_model_name = source.name
    return source, cfg


def _check_quantization(source, cfg, cuda: bool) -> None:
    """What the stages would refuse, refused before any starts."""
    from stage_worker.quantization import check_quantization

    check_quantization(source.quantization, cfg, "cuda" if cuda else "cpu")


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
