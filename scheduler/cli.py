"""`stagemesh scheduler`: one data-parallel replica's scheduler."""
from __future__ import annotations

import argparse
import asyncio
import logging
from dataclasses import replace

from stagemesh.core import internal_token
from stagemesh.core.deadlines import DEADLINES
from stagemesh.core.errors import StagemeshError
from stagemesh.core.heap import freeze_startup_heap
from stagemesh.core.lora import add_lora_arguments, lora_from_args, read_adapter_config
from stagemesh.core.service_options import add_service_arguments, setup_service

log = logging.getLogger("stagemesh.scheduler")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None, help="model directory (default: the embedded model)")
    from stagemesh.core.model_source import add_model_arguments

    add_model_arguments(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=50051, help="gRPC port (0: any free port)")
    p.add_argument("--advertise-host", default=None, help="address stages use to reach this host")
    p.add_argument("--dist-port", type=int, default=0, help="torch.distributed store port (0: any free port)")
    p.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1)
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--max-waiting-requests", type=int, default=0, help="0: unbounded")
    add_lora_arguments(p)
    p.add_argument("--scheduling-policy", choices=("fcfs", "priority"), default="fcfs",
                   help="fcfs: requests in arrival order; priority: by the request's priority (lower first, ties by "
                        "arrival), the lowest-priority running request preempted for a higher one that lacks KV "
                        "blocks (vLLM's); a non-zero priority under fcfs is refused")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="schedule a step before the previous one's tokens are back, so the stages do not wait for "
                        "the scheduler: always with one stage, with more where a micro-batch would be empty "
                        "(default: on when the stages run on GPUs, off on CPU)")
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help="vLLM's speculative decoding config (JSON): method ngram (prompt lookup, proposed here: "
                        "num_speculative_tokens, prompt_lookup_max, prompt_lookup_min) or draft_model (\"model\": "
                        "the draft, which the last stage runs with the same flag); not with --async-scheduling")
    p.add_argument("--stage-recovery-timeout", type=float, default=30.0,
                   help="when a stage fails, keep its requests this many seconds for the pipeline to re-form (the "
                        "stage restarted, or a --standby stage took its place), then go on with them; after that "
                        "they fail (the router continues them on another replica). 0: fail them at once")
    p.add_argument("--max-request-retries", type=int, default=3,
                   help="a request under which the pipeline broke more than this many times fails")
    p.add_argument("--forward-timeout", type=float, default=DEADLINES.forward_s,
                   help="deadline of one step on a stage, seconds")
    p.add_argument("--kv-role", choices=("both", "prefill", "decode"), default="both",
                   help="disaggregated prefill (docs/disaggregated-prefill.md): a router sends a prefill replica "
                        "new prompts (it computes the prompt and the first token and holds the KV), and a decode "
                        "replica the rest, whose stages fetch that KV; every role also serves whole requests")
    p.add_argument("--kv-peer", action="append", default=[], metavar="HOST:PORT",
                   help="disaggregated prefill: the scheduler of a prefill replica whose held KV this replica may "
                        "fetch (repeat for each); a request's kv_transfer naming any other is not fetched (its "
                        "--kv-load-failure-policy applies), and this replica's stages read KV only from these "
                        "replicas' stages (`stagemesh serve --prefill-replicas` gives it to every decode replica)")
    p.add_argument("--kv-hold-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="a prefilled request's KV blocks wait this long at most for a decode replica to fetch them")
    add_kv_load_arguments(p)
    p.add_argument("--resume-grace-period", type=float, default=30.0, metavar="SECONDS",
                   help="a streamed request whose router went away (died, or stopped) keeps running this long, its "
                        "output kept, for another router to resume it (a client's Last-Event-ID, or "
                        "stagemesh.client by itself); then it is aborted and its KV freed. 0: abort at once")
    add_kv_tier_arguments(p)
    p.add_argument("--port-file", default=None, help="write the bound port here (for supervisors)")
    add_service_arguments(p)


def add_kv_tier_arguments(p: argparse.ArgumentParser) -> None:
    """The KV tiers' sizes (docs/kv-tiers.md), the scheduler's and `stagemesh serve`'s."""
    p.add_argument("--kv-offloading-size", type=float, default=None, metavar="GiB",
                   help="KV tiers (vLLM's flag): host memory for KV blocks below the KV cache, in GiB for the whole "
                        "replica (every stage and TP rank together); a prefix evicted from the KV cache, or cached "
                        "before a new epoch, is loaded back from it instead of computed")
    p.add_argument("--kv-offloading-backend", default=None, choices=("native", "lmcache"),
                   help="KV tiers (vLLM's flag): native, the built-in host and disk tiers (the default); lmcache is "
                        "refused (not built in)")
    p.add_argument("--kv-offloading-disk-size", type=float, default=None, metavar="GiB",
                   help="KV tiers: disk for KV blocks below the host tier, in GiB for the whole replica, in the "
                        "stages' --kv-offloading-disk-path directories; it outlives the processes, so a restarted "
                        "replica serves the prefixes it cached before (needs --kv-offloading-size)")


def kv_tier_bytes(args: argparse.Namespace) -> tuple[int, int]:
    """(host, disk) bytes of the KV tiers from the flags, checked."""
    if args.kv_offloading_backend == "lmcache":
        raise StagemeshError("--kv-offloading-backend lmcache: LMCache is not built into stagemesh; use the built-in "
                             "tiers (--kv-offloading-backend native, the default)")
    sizes = []
    for flag, value in (("--kv-offloading-size", args.kv_offloading_size),
                        ("--kv-offloading-disk-size", args.kv_offloading_disk_size)):
        if value is not None and not 0 <= value < 2**40:
            raise StagemeshError(f"{flag} takes GiB >= 0, got {value}")
        sizes.append(int((value or 0) * 2**30))
    if sizes[1] and not sizes[0]:
        raise StagemeshError("--kv-offloading-disk-size needs --kv-offloading-size: blocks reach the disk tier "
                             "through the host tier")
    if args.kv_offloading_backend == "native" and not sizes[0]:
        raise StagemeshError("--kv-offloading-backend native needs --kv-offloading-size (vLLM's rule)")
    return sizes[0], sizes[1]


def _lora_table(args):
    """--enable-lora's adapters (scheduler.lora_table.LoRATable, or None), their configs read (the stages read
    their weights): the names requests may ask for, which change as adapters are loaded at run time."""
    from scheduler.lora_table import LoRATable

    lora = lora_from_args(args)
    if lora is None:
        return None
    limits, modules = lora
    for m in modules:
        read_adapter_config(m.name, m.path, limits.max_lora_rank)
    log.info("LoRA adapters %s (--max-loras %d)", ", ".join(m.name for m in modules) or "none", limits.max_loras)
    return LoRATable(limits.max_loras, limits.max_lora_rank, tuple(args.allowed_local_lora_path),
                     {m.name: m.path for m in modules})


def add_kv_load_arguments(p: argparse.ArgumentParser) -> None:
    """The decode side's KV load flags, shared with `stagemesh serve` (docs/disaggregated-prefill.md)."""
    # (no `choices`: a wrong value is refused with the flag's name and what it takes, by check_kv_load_arguments)
    p.add_argument("--kv-load-failure-policy", default="fail", metavar="fail|recompute",
                   help="vLLM's kv_load_failure_policy: what a request does whose prompt's KV cannot be loaded from "
                        "its prefill replica (the fetch failed, ran past --kv-load-timeout, or the hold had expired): "
                        "fail (the default, as vLLM's: it fails with the reason and the router prefills it again, "
                        "once, on a prefill replica) or recompute (this replica computes its prompt)")
    p.add_argument("--kv-load-timeout", type=float, default=10.0, metavar="SECONDS",
                   help="bound on fetching a prompt's KV from a prefill replica; past it (a stalled prefill "
                        "replica) the --kv-load-failure-policy applies")


def check_kv_load_arguments(args: argparse.Namespace) -> None:
    from scheduler.config import KV_LOAD_FAILURE_POLICIES

    if args.kv_load_failure_policy not in KV_LOAD_FAILURE_POLICIES:
        raise StagemeshError(f"--kv-load-failure-policy must be fail or recompute (vLLM's kv_load_failure_policy), "
                             f"got {args.kv_load_failure_policy[:100]!r}")
    if not args.kv_load_timeout > 0:
        raise StagemeshError(f"--kv-load-timeout must be > 0 seconds, got {args.kv_load_timeout}")


def _check_kv_peers(peers: list[str], kv_role: str) -> None:
    for address in peers:
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            raise StagemeshError(f"--kv-peer takes a prefill replica's scheduler as HOST:PORT; got {address!r}")
    if peers and kv_role == "prefill":
        raise StagemeshError("--kv-peer is for a replica that fetches KV (--kv-role decode or both), not a prefill one")
    if kv_role == "decode" and not peers:
        log.warning("--kv-role decode without --kv-peer: no prefill replica's KV can be fetched, every prompt is "
                    "computed here")


def run(args: argparse.Namespace) -> int:
    setup_service(args, "stagemesh-scheduler")
    return asyncio.run(_main(args))


async def _main(args: argparse.Namespace) -> int:
    from scheduler.config import SchedulerConfig
    from scheduler.driver import Driver, DriverConfig
    from scheduler.grpc_pipeline import GrpcPipeline
    from scheduler.kv_peers import KVPeers
    from scheduler.rendezvous import ModelIdentity, Rendezvous
    from scheduler.service import SchedulerServicer, serve
    from stagemesh.core.model_config import ModelConfig
    from stagemesh.core.shutdown import Shutdown
    from stagemesh.core.speculative import parse_speculative_config
    from stagemesh.core.model_source import resolve_source

    source = resolve_source(args.model, args.tokenizer, args.quantization)  # a GGUF's config: its --tokenizer
    model_dir = source.model_dir
    cfg = ModelConfig.from_path(model_dir)
    if args.max_model_len is not None and args.max_model_len > cfg.max_position_embeddings:
        raise StagemeshError(f"--max-model-len {args.max_model_len} exceeds the model's "
                             f"{cfg.max_position_embeddings} positions")
    if args.pipeline_parallel_size < 1 or args.pipeline_parallel_size > cfg.num_hidden_layers:
        raise StagemeshError(f"--pipeline-parallel-size must be between 1 and the model's "
                             f"{cfg.num_hidden_layers} layers")
    if args.stage_recovery_timeout < 0 or args.max_request_retries < 0:
        raise StagemeshError("--stage-recovery-timeout and --max-request-retries must be >= 0")
    if args.resume_grace_period < 0:
        raise StagemeshError("--resume-grace-period must be >= 0")
    if not args.kv_hold_timeout > 0:
        raise StagemeshError("--kv-hold-timeout must be > 0")
    _check_kv_peers(args.kv_peer, args.kv_role)
    tier_host, tier_disk = kv_tier_bytes(args)
    if tier_host and not args.enable_prefix_caching:
        raise StagemeshError("--kv-offloading-size needs prefix caching: the KV tiers hold prefix-cache blocks "
                             "(drop --no-enable-prefix-caching)")
    check_kv_load_arguments(args)
    shutdown = Shutdown(args.shutdown_timeout, log, "scheduler")
    shutdown.install_async()
    advertise = args.advertise_host or args.host
    store = _store(args.host, args.dist_port)
    internal_token.warn_if_open("scheduler")
    identity = ModelIdentity(cfg.model_type, cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size,
                             cfg.num_attention_heads, cfg.num_key_value_heads)
    spec = parse_speculative_config(args.speculative_config)
    draft_tokens = spec.num_speculative_tokens if spec is not None and spec.uses_draft_model else 0
    lora = _lora_table(args)
    rendezvous = Rendezvous(args.pipeline_parallel_size, args.block_size, identity, draft_tokens, lora)
    driver = Driver(DriverConfig(
        SchedulerConfig(max_model_len=args.max_model_len, block_size=args.block_size, max_num_seqs=args.max_num_seqs,
                        max_num_batched_tokens=args.max_num_batched_tokens,
                        enable_prefix_caching=args.enable_prefix_caching, eos_token_ids=cfg.eos_token_ids,
                        max_waiting_requests=args.max_waiting_requests, vocab_size=cfg.vocab_size,
                        scheduling_policy=args.scheduling_policy, kv_hold_timeout_s=args.kv_hold_timeout,
                        kv_load_failure_policy=args.kv_load_failure_policy, kv_load_timeout_s=args.kv_load_timeout,
                        speculative=spec, lora=lora),
        model_max_len=cfg.max_position_embeddings, async_scheduling=args.async_scheduling,
        stage_recovery_timeout_s=args.stage_recovery_timeout, max_request_retries=args.max_request_retries,
        kv_offloading_bytes=tier_host, kv_offloading_disk_bytes=tier_disk),
        GrpcPipeline(rendezvous, advertise, store.port, replace(DEADLINES, forward_s=args.forward_timeout)))
    name = args.served_model_name or source.name
    servicer = SchedulerServicer(driver, name, str(model_dir), cfg.vocab_size, args.kv_role,
                                 args.resume_grace_period, KVPeers(tuple(args.kv_peer)))
    server, port = await serve(servicer, args.host, args.port)
    driver.observer.replica = servicer.address = f"{advertise}:{port}"
    if args.port_file:
        with open(args.port_file, "w") as f:
            f.write(f"{port}\n")
    role = "" if args.kv_role == "both" else f"; {args.kv_role} replica of a disaggregated mesh"
    log.info("scheduler for %s listening on %s:%d (store on port %d), waiting for %d stage(s)%s", name, args.host,
             port, store.port, args.pipeline_parallel_size, role)
    freeze_startup_heap("scheduler")
    runner = asyncio.create_task(driver.run())
    stopping = asyncio.create_task(shutdown.wait())
    refused = asyncio.create_task(driver.refused())
    await asyncio.wait({runner, stopping, refused}, return_when=asyncio.FIRST_COMPLETED)
    code = 0
    if refused.done():  # exit 2: a supervisor (serve) restarts no service for a configuration it refuses
        runner.cancel()
        stopping.cancel()
        await server.stop(grace=1)
        raise StagemeshError(refused.result())
    refused.cancel()
    if runner.done():  # the step loop must never end: exit so that a supervisor restarts the scheduler
        log.error("the step loop ended: %r", runner.exception() if not runner.cancelled() else "cancelled")
        code = 1
    else:
        await _drain(shutdown, servicer, driver)
    runner.cancel()
    stopping.cancel()
    await server.stop(grace=1)
    return code


async def _drain(shutdown, servicer, driver) -> None:
    """Readiness off (routers send new work elsewhere), the requests it has finish; those left when
    --shutdown-timeout ends fail as UNAVAILABLE, which their routers continue on another replica, token-exact."""
    servicer.drain.stopping = True
    if not await shutdown.drain(lambda: servicer.unfinished() == 0, lambda: f"{servicer.unfinished()} request(s)"):
        moved = driver.evacuate("the replica shut down (its --shutdown-timeout ended)")
        log.warning("%d request(s) handed back to their routers to go on on another replica", moved)
        await asyncio.sleep(0.5)  # their failures reach the routers before the streams close


def _store(host: str, port: int):
    """The replica's torch.distributed store, listening where the gRPC services listen (TCPStore alone
    binds every interface): on a socket bound here, handed over."""
    import socket

    import torch.distributed as dist

    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, _, _, _, address = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as err:
        sock.close()
        raise StagemeshError(f"--dist-port {port}: cannot listen on {host}: {err.strerror}") from None
    sock.listen(1024)
    store = dist.TCPStore(host, sock.getsockname()[1], is_master=True, wait_for_workers=False,
                          master_listen_fd=sock.detach())
    return store
