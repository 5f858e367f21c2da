"""`stagemesh scheduler`: one data-parallel replica's scheduler."""
from __future__ import annotations

import argparse
import asyncio
import logging
from dataclasses import replace

from stagemesh.core import event_loop, internal_token
from stagemesh.core.common_flags import skip_server_warmup
from stagemesh.core.deadlines import DEADLINES
from stagemesh.core.errors import StagemeshError
from stagemesh.core.heap import freeze_startup_heap
from stagemesh.core.flags import add_flags
from stagemesh.core.lora import lora_from_args, read_adapter_config
from stagemesh.core.service_options import setup_service

log = logging.getLogger("stagemesh.scheduler")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from scheduler.config import SchedulerOptions

    add_flags(p, SchedulerOptions)


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
    return event_loop.run(_main(args))


async def _main(args: argparse.Namespace) -> int:
    from scheduler.kv_peers import KVPeers
    from scheduler.service import SchedulerServicer, serve
    from stagemesh.core.model_config import ModelConfig
    from stagemesh.core.model_source import resolve_source
    from stagemesh.core.shutdown import Shutdown

    source = resolve_source(args.model, args.tokenizer, args.quantization)  # a GGUF's config: its --tokenizer
    cfg = ModelConfig.from_path(source.model_dir)
    tier_bytes = _check_args(args, cfg)
    shutdown = Shutdown(args.shutdown_timeout, log, "scheduler")
    shutdown.install_async()
    advertise = args.advertise_host or args.host
    store = _store(args.host, args.dist_port)
    internal_token.warn_if_open("scheduler")
    driver = _driver(args, cfg, tier_bytes, advertise, store.port)
    name = args.served_model_name or source.name
    servicer = SchedulerServicer(driver, name, str(source.model_dir), cfg.vocab_size, args.kv_role,
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
    try:
        return await _serve_until_stopped(shutdown, servicer, driver)
    finally:
        await server.stop(grace=1)


def _check_args(args: argparse.Namespace, cfg) -> tuple[int, int]:
    """StagemeshError for flags that do not go together or with the model; the KV tiers' (host, disk) bytes."""
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
    if not args.grammar_compile_timeout > 0:
        raise StagemeshError(f"--grammar-compile-timeout must be > 0, got {args.grammar_compile_timeout}")
    _check_kv_peers(args.kv_peer, args.kv_role)
    tier_host, tier_disk = kv_tier_bytes(args)
    if tier_host and not args.enable_prefix_caching:
        raise StagemeshError("--kv-offloading-size needs prefix caching: the KV tiers hold prefix-cache blocks "
                             "(drop --no-enable-prefix-caching)")
    check_kv_load_arguments(args)
    return tier_host, tier_disk


def _driver(args: argparse.Namespace, cfg, tier_bytes: tuple[int, int], advertise: str, store_port: int):
    """The replica's driver: its scheduler's config from the flags and the model, over a pipeline of stages that
    register at this scheduler (rendezvous on the store)."""
    from scheduler.config import SchedulerConfig
    from scheduler.driver import Driver, DriverConfig
    from scheduler.grpc_pipeline import GrpcPipeline
    from scheduler.rendezvous import ModelIdentity, Rendezvous
    from stagemesh.core.speculative import parse_speculative_config

    identity = ModelIdentity(cfg.model_type, cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size,
                             cfg.num_attention_heads, cfg.num_key_value_heads)
    spec = parse_speculative_config(args.speculative_config)
    draft_tokens = spec.num_speculative_tokens if spec is not None and spec.uses_draft_model else 0
    lora = _lora_table(args)
    rendezvous = Rendezvous(args.pipeline_parallel_size, args.block_size, identity, draft_tokens, lora,
                            args.kv_cache_dtype)
    scheduler = SchedulerConfig(
        max_model_len=args.max_model_len, block_size=args.block_size, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=args.enable_prefix_caching,
        eos_token_ids=cfg.eos_token_ids, max_waiting_requests=args.max_waiting_requests, vocab_size=cfg.vocab_size,
        scheduling_policy=args.scheduling_policy, tenant_fair_share=args.tenant_fair_share,
        kv_hold_timeout_s=args.kv_hold_timeout, migration_policy=args.migration_policy,
        kv_load_failure_policy=args.kv_load_failure_policy, kv_load_timeout_s=args.kv_load_timeout,
        speculative=spec, lora=lora)
    return Driver(DriverConfig(
        scheduler, model_max_len=cfg.max_position_embeddings, async_scheduling=args.async_scheduling,
        stage_recovery_timeout_s=args.stage_recovery_timeout, max_request_retries=args.max_request_retries,
        kv_offloading_bytes=tier_bytes[0], kv_offloading_disk_bytes=tier_bytes[1],
        grammar_compile_timeout_s=args.grammar_compile_timeout,
        warm_up=not skip_server_warmup(args.skip_server_warmup)),
        GrpcPipeline(rendezvous, advertise, store_port, replace(DEADLINES, forward_s=args.forward_timeout)))


async def _serve_until_stopped(shutdown, servicer, driver) -> int:
    """Run the step loop until told to stop (drained: 0), until it ends (1: a supervisor restarts the scheduler)
    or until the stages' configuration is refused (StagemeshError, exit 2: no supervisor restarts it)."""
    runner = asyncio.create_task(driver.run())
    stopping = asyncio.create_task(shutdown.wait())
    refused = asyncio.create_task(driver.refused())
    try:
        await asyncio.wait({runner, stopping, refused}, return_when=asyncio.FIRST_COMPLETED)
        if refused.done():
            raise StagemeshError(refused.result())
        if runner.done():  # the step loop must never end
            log.error("the step loop ended: %r", runner.exception() if not runner.cancelled() else "cancelled")
            return 1
        await _drain(shutdown, servicer, driver)
        return 0
    finally:
        for task in (runner, stopping, refused):
            task.cancel()


async def _drain(shutdown, servicer, driver) -> None:
    """Readiness off (routers send new work elsewhere), the requests it has finish; those left when
    --shutdown-timeout ends are handed back to their routers (Driver.migrate), which continue them on another
    replica, token-exact: with their KV under --migration-policy kv, which this replica's stages serve until the
    other replica has read it (at most --kv-hold-timeout), else computed again there."""
    servicer.drain.stopping = True
    if await shutdown.drain(lambda: servicer.unfinished() == 0, lambda: f"{servicer.unfinished()} request(s)"):
        return
    with_kv, without = await driver.migrate("the replica shut down (its --shutdown-timeout ended)",
                                            driver.cfg.scheduler.kv_hold_timeout_s)
    log.warning("%d request(s) handed back to their routers to go on on another replica (%d with their KV)",
                with_kv + without, with_kv)
    await asyncio.sleep(0.5)  # their outputs reach the routers before the streams close
    deadline = asyncio.get_running_loop().time() + driver.cfg.scheduler.kv_hold_timeout_s
    while driver.holds_kv() and asyncio.get_running_loop().time() < deadline and not shutdown.hurry.is_set():
        await asyncio.sleep(0.1)
    if driver.holds_kv():
        log.warning("%d request(s)' KV not read by another replica within --kv-hold-timeout: they go on computed "
                    "again there", driver.holds_kv())


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
