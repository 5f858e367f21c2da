"""`stagemesh stage`: one pipeline stage worker (TP rank 0 + its followers)."""
from __future__ import annotations

import argparse
import logging
import signal
import threading

import grpc

from stagemesh.core import internal_token
from stagemesh.core.deadlines import DEADLINES
from stagemesh.core.errors import StagemeshError
from stagemesh.core.heap import freeze_startup_heap
from stagemesh.core.flags import add_flags
from stagemesh.core.service_options import channel, setup_service

log = logging.getLogger("stagemesh.stage")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from stage_worker.options import StageOptions

    add_flags(p, StageOptions)


def expert_parallel_across_replicas(args: argparse.Namespace, cfg, start: int, end: int):
    """The stage's EPConfig under --data-parallel-size > 1, after the checks of what is built; else None."""
    from stage_worker.ep_group import EPConfig

    if args.data_parallel_size == 1:
        return None
    if not args.enable_expert_parallel:
        raise StagemeshError("--data-parallel-size on a stage spreads its experts over the replicas: it needs "
                             "--enable-expert-parallel (plain data parallelism needs no stage flag)")
    ep = EPConfig(args.data_parallel_rank, args.data_parallel_size, args.data_parallel_address,
                  args.data_parallel_rpc_port)
    ep.check()
    cfg.check_expert_parallel(ep.dp_size, across_replicas=True)
    not_built = []
    if args.tensor_parallel_size != 1:
        not_built.append(f"--tensor-parallel-size {args.tensor_parallel_size} (the group is one stage rank per "
                         "replica)")
    if (start, end) != (0, cfg.num_hidden_layers):
        not_built.append(f"--layers {start}:{end} (one stage per replica holds every layer: the group's steps "
                         "would wait on the pipeline's handoffs)")
    if args.device != "cpu":
        not_built.append("--device cuda (the group's collectives are gloo; NCCL is not built)")
    if not_built:
        raise StagemeshError("expert parallelism across data-parallel replicas is built for TP=1, PP=1 CPU stages "
                             "only; not yet with " + "; ".join(not_built))
    return ep


def eplb_config(args: argparse.Namespace, cfg):
    """The stage's EPLBConfig under --enable-eplb (after the checks of what is built), else None."""
    from stage_worker.eplb import EPLBConfig

    if not args.enable_eplb:
        if args.eplb_config is not None:
            raise StagemeshError("--eplb-config needs --enable-eplb")
        return None
    if not cfg.is_moe or not args.enable_expert_parallel or args.tensor_parallel_size < 2:
        raise StagemeshError("--enable-eplb balances the experts of a mixture-of-experts model spread over a stage's "
                             "TP ranks: it needs --enable-expert-parallel and --tensor-parallel-size 2 or more")
    if args.data_parallel_size > 1:
        raise StagemeshError("--enable-eplb with experts across data-parallel replicas is not built yet (only over "
                             "a stage's TP ranks)")
    return EPLBConfig.parse(args.eplb_config, cfg.num_experts, args.tensor_parallel_size)


def stage_speculation(args: argparse.Namespace, cfg, layer_end: int):
    """The draft model of --speculative-config (the last stage's only), or None."""
    from stagemesh.core.speculative import parse_speculative_config

    spec = parse_speculative_config(args.speculative_config)
    if spec is None:
        return None
    if not spec.uses_draft_model:
        raise StagemeshError("--speculative-config method ngram is the scheduler's (it proposes the drafts from "
                             "the request's tokens): give it to `stagemesh scheduler`, not to a stage")
    if layer_end != cfg.num_hidden_layers:
        raise StagemeshError("--speculative-config with a draft model goes to the last stage only (it verifies "
                             "the drafts and proposes the next ones)")
    return spec


def parse_layers(text: str) -> tuple[int, int]:
    try:
        start, end = (int(x) for x in text.split(":"))
    except ValueError:
        raise StagemeshError(f"--layers {text!r} must be A:B, e.g. 0:15") from None
    return start, end


def stage_layers(args: argparse.Namespace, num_layers: int) -> tuple[int, int]:
    """The stage's layer range: --layers, or its share of the pipeline's split."""
    from stagemesh.core.model_config import layer_ranges, layer_split, parse_layer_split

    pp = args.pipeline_parallel_size
    if args.layers is not None:
        if pp is not None or args.layer_split is not None:
            raise StagemeshError("give either --layers or --pipeline-parallel-size (with --layer-split), not both")
        return parse_layers(args.layers)
    if pp is None:
        raise StagemeshError("give the stage's layers: --layers A:B, or --pipeline-parallel-size N (and "
                             "--layer-split) for its --stage-index's share of the split")
    if args.layer_split is not None:
        split = parse_layer_split(args.layer_split, num_layers, pp)
    else:
        split = layer_split(num_layers, pp)
    if not 0 <= args.stage_index < pp:
        raise StagemeshError(f"--stage-index {args.stage_index} is out of range for --pipeline-parallel-size {pp}")
    return layer_ranges(split)[args.stage_index]


def run(args: argparse.Namespace) -> int:
    from stagemesh.core.model_config import ModelConfig
    from stagemesh.core.model_source import resolve_source
    from stage_worker.ep_group import BROKEN_LINGER_S, EXIT_BROKEN, EPGroupBroken
    from stage_worker.gloo_interface import configure_gloo_interface
    from stage_worker.runner import check_layer_range
    from stagemesh.core.shutdown import Shutdown

    setup_service(args, f"stagemesh-stage-{args.stage_index}")
    configure_gloo_interface()  # on a Ray node: gloo on the interface of the node's address
    stop = threading.Event()  # ends the main loop: the drain sets it, or a second signal, or the drain's time
    shutdown = Shutdown(args.shutdown_timeout, log, f"stage {args.stage_index}", force_stop=stop.set)
    for sig in (signal.SIGTERM, signal.SIGINT):  # until it serves: nothing to drain, stop at once
        signal.signal(sig, _stop_starting)
    source = resolve_source(args.model, args.tokenizer, args.quantization)
    model_dir = source.model_dir
    cfg = ModelConfig.from_path(model_dir)
    start, end = stage_layers(args, cfg.num_hidden_layers)
    check_layer_range(cfg, start, end)
    cfg.check_tp_size(args.tensor_parallel_size)
    if args.enable_expert_parallel:
        cfg.check_expert_parallel(args.tensor_parallel_size)
    if args.standby and args.data_parallel_size > 1:
        raise StagemeshError("--standby with --data-parallel-size > 1 is not supported: an expert-parallel group "
                             "re-forms with the restarted member (stage_worker.ep_group)")
    ep = expert_parallel_across_replicas(args, cfg, start, end)
    balance = eplb_config(args, cfg)
    spec = stage_speculation(args, cfg, end)
    from stage_worker.lora import LoRASettings

    lora = LoRASettings.from_args(args)
    if args.kv_offloading_disk_path:  # before the weights load: a bad directory is refused at once
        from stage_worker.kv_disk import check_writable

        check_writable(args.kv_offloading_disk_path)
    if args.cpu_affinity:
        import os

        try:
            os.sched_setaffinity(0, {int(c) for c in args.cpu_affinity.split(",")})
        except (ValueError, OSError) as err:
            raise StagemeshError(f"--cpu-affinity {args.cpu_affinity!r}: {err}") from None
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    from stage_worker.kv_connector import PeerStages
    from stage_worker.service import ServerThread, StageServicer
    from stage_worker.runner import SliceConfig
    from stage_worker.worker import StageConfig, StageWorker

    slice_ = SliceConfig(str(model_dir), start, end, tp_size=args.tensor_parallel_size, device=args.device,
                         dtype=args.dtype, block_size=args.block_size, cuda_graphs=not args.enforce_eager,
                         expert_parallel=args.enable_expert_parallel, eplb=balance, quantization=source.quantization,
                         gguf_file=str(source.gguf_file) if source.gguf_file else None, lora=lora)
    worker = StageWorker(StageConfig(slice_, args.stage_index, handoff=args.handoff,
                                     kv_cache_memory=args.kv_cache_memory,
                                     gpu_memory_utilization=args.gpu_memory_utilization, threads=args.threads,
                                     ep=ep, standby=args.standby, speculative=spec,
                                     kv_disk_path=args.kv_offloading_disk_path))
    if args.standby:  # warm: a join with the stage's own number of blocks finds its cache ready
        worker.runner.allocate_kv_cache(worker.num_kv_blocks)
    internal_token.warn_if_open(f"stage {args.stage_index}")
    if args.device == "cpu":
        from kernels import cpu_ops
        from stage_worker.cpu_isa import cpu_flags, describe_cpu_path, describe_isa

        built = cpu_ops.load() is not None
        log.info("stage %d: %s; %s", args.stage_index, describe_cpu_path(
            str(worker.runner.dtype).removeprefix("torch."), cpu_flags(), kernels=built),
            describe_isa(cpu_flags(), built))
    if source.quantization:
        from stage_worker.quantization import describe

        log.info("stage %d: --quantization %s%s: %s", args.stage_index, source.quantization,
                 f" from {source.gguf_file}" if source.gguf_file else "", describe(worker.runner.model))
    if lora is not None:
        log.info("stage %d: LoRA adapters %s (--max-loras %d, --max-lora-rank %d)", args.stage_index,
                 ", ".join(m.name for m in lora.modules) or "none", lora.limits.max_loras, lora.limits.max_lora_rank)
    if cfg.is_moe:
        from stage_worker.moe import describe_layout
        from stage_worker.observe import watch_expert_load

        log.info("stage %d experts: %s", args.stage_index,
                 describe_layout(cfg, args.tensor_parallel_size, args.enable_expert_parallel, worker.ep))
        watch_expert_load(args.stage_index, worker.runner.model)
    from stage_worker.kv_tier_metrics import watch_kv_tiers

    watch_kv_tiers(args.stage_index, worker.tiers)
    servicer = StageServicer(worker, "", PeerStages(args.scheduler))
    server = ServerThread(servicer, args.host, args.port)
    failed: list[BaseException] = []
    try:
        if worker.ep is not None:  # the replica is not whole until its experts' group is
            worker.ep.form()
        port = server.start()
        servicer.address = f"{args.advertise_host or args.host}:{port}"
        log.info("stage %d serving layers %d:%d at %s (TP=%d, %s, %s handoff, %d KV blocks of %d tokens)",
                 args.stage_index, start, end, servicer.address, args.tensor_parallel_size, args.device, args.handoff,
                 worker.num_kv_blocks, args.block_size)
        shutdown.install()  # a drain: the replica takes no new work, the stage leaves once its work is done

        def supervise() -> None:
            try:
                keep_registered(args.scheduler, servicer, stop, shutdown, server)
            except BaseException as err:  # noqa: BLE001 - re-raised on the main thread
                failed.append(err)
                stop.set()

        freeze_startup_heap("stage")
        worker.steps.start()  # from here on the model's work waits for the loop below
        threading.Thread(target=supervise, name="register", daemon=True).start()
        worker.steps.run_until(stop, idle=worker.ep)  # the model's work runs here, on the thread that loaded it
        if failed:
            raise failed[0]
    except EPGroupBroken as err:
        if stop.is_set():  # a member that stopped first, as the whole mesh stops
            log.info("stopping: %s", err)
            return 0
        log.error("%s", err)
        # a step the scheduler sends meanwhile gets this reason (steps now fail at once), not a refused
        # connection
        stop.wait(BROKEN_LINGER_S)
        return EXIT_BROKEN
    finally:
        server.stop(grace=1)
        worker.close()
    return 0


def _stop_starting(signum, _frame) -> None:
    log.info("signal %d during start-up: stopping", signum)
    raise SystemExit(0)


def keep_registered(scheduler: str, servicer, stop: threading.Event, shutdown=None, server=None,
                    interval_s: float = 2.0) -> None:
    """Register with the scheduler, then again every interval for as long as the stage runs: a heartbeat
    that a restarted scheduler answers by taking the stage back. Retries an unreachable scheduler
    forever (with backoff); a refusal ends the stage with the scheduler's reason. A TP follower that
    died ends it too (the stage cannot serve without it; its supervisor restarts it).

    Told to stop (`shutdown`), the stage drains: its heartbeats say so, every DRAIN_BEAT_S, and the replica
    takes no new requests; it stops once the scheduler has none left (or cannot be reached) or its
    --shutdown-timeout ends (the scheduler keeps what is left for the stage that comes back)."""
    from stagemesh.v1 import scheduler_pb2, scheduler_pb2_grpc

    delay, warned = 0.2, False
    with channel(scheduler) as chan:
        stub = scheduler_pb2_grpc.SchedulerStub(chan)
        while not stop.is_set():
            if not servicer.worker.followers_alive():
                raise StagemeshError("a TP follower of this stage died; the stage stops")
            draining = shutdown is not None and shutdown.requested.is_set()
            if draining and not servicer.draining:
                servicer.draining = True
                if server is not None:
                    server.set_ready(False)
            try:
                reply = stub.RegisterStage(scheduler_pb2.RegisterStageRequest(stage=servicer.describe()),
                                           timeout=DEADLINES.register_s)
                if sync_lora(servicer.worker, reply.lora_adapters):
                    continue  # registers again at once, serving the scheduler's adapters
                if reply.first_seen:
                    log.info("registered with the scheduler at %s (%d stage(s) still missing)", scheduler,
                             reply.num_missing_stages)
                delay, warned = interval_s, False
                if draining and _drained(shutdown, reply.num_unfinished_requests, stop):
                    return
            except grpc.RpcError as err:
                if err.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION,
                                  grpc.StatusCode.UNAUTHENTICATED):
                    raise StagemeshError(f"the scheduler refused this stage: {err.details()}") from None
                if draining:  # nothing to wait for
                    log.info("draining: no scheduler answers (%s): stopping", err.code().name)
                    stop.set()
                    return
                if not warned:
                    warned = True
                    log.warning("no scheduler answers at %s (%s); retrying", scheduler, err.code().name)
                delay = min(delay * 2, interval_s)
            if shutdown is None:
                stop.wait(delay)
            else:  # told to stop, the stage says so in its next heartbeat at once, not a beat later
                (shutdown.hurry if draining else shutdown.requested).wait(DRAIN_BEAT_S if draining else delay)
            if shutdown is not None and shutdown.hurry.is_set():
                stop.set()


DRAIN_BEAT_S = 0.2
LORA_LOAD_WAIT_S = 120.0


def sync_lora(worker, adapters) -> bool:
    """The scheduler's adapters this stage lacks (loaded at run time while the stage was away): read them now.
    True when it read any (the stage is not in the pipeline until it serves them all)."""
    lora = worker.runner.lora
    if lora is None:
        return False
    missing = [a for a in adapters if a.name not in lora.modules]
    for a in missing:
        log.info("reading LoRA adapter %r (%s), which the scheduler serves (waiting at most %.0fs)", a.name, a.path,
                 LORA_LOAD_WAIT_S)
        try:
            worker.load_lora(a.name, lora.settings.runtime_path(a.name, a.path)).result(LORA_LOAD_WAIT_S)
        except (StagemeshError, TimeoutError) as err:
            raise StagemeshError(f"the scheduler serves LoRA adapter {a.name!r}, which this stage cannot: "
                                 f"{err}") from None
    return bool(missing)


def _drained(shutdown, unfinished: int, stop: threading.Event) -> bool:
    """Whether a draining stage stops now: its replica has nothing left, or the time is up."""
    if unfinished and shutdown.left_s > 0:
        return False
    if unfinished:
        log.warning("the drain ended with %d request(s) left in the replica: they wait for this stage's "
                    "replacement", unfinished)
    else:
        log.info("drained: the replica has no request left; stopping")
    stop.set()
    return True
