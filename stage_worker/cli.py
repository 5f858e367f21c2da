"""`stagemesh stage`: one pipeline stage worker (TP rank 0 + its followers)."""
from __future__ import annotations

import argparse
import logging
import os
import signal
import threading
from dataclasses import dataclass
from typing import Any, Callable


from stagemesh.core import internal_token
from stagemesh.core.errors import StagemeshError
from stagemesh.core.heap import freeze_startup_heap
from stagemesh.core.flags import add_flags
from stagemesh.core.service_options import setup_service

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


@dataclass(frozen=True)
class StagePlan:
    """What the flags and the model's config make of this stage, checked before any weight is read."""
    source: Any  # stagemesh.core.model_source.ModelSource
    cfg: Any  # stagemesh.core.model_config.ModelConfig
    start: int
    end: int
    ep: Any  # stage_worker.ep_group.EPConfig, with experts across the replicas
    eplb: Any  # stage_worker.eplb.EPLBConfig, with --enable-eplb
    spec: Any  # the draft model's stagemesh.core.speculative.SpeculativeConfig (the last stage's)
    lora: Any  # stage_worker.lora.LoRASettings, with --enable-lora


def run(args: argparse.Namespace) -> int:
    """Check, load, describe, serve: each a step below. Until the stage serves, a signal stops it at once."""
    from stage_worker.gloo_interface import configure_gloo_interface
    from stagemesh.core.shutdown import Shutdown

    setup_service(args, f"stagemesh-stage-{args.stage_index}")
    configure_gloo_interface()  # on a Ray node: gloo on the interface of the node's address
    stop = StageStop()  # ends the main loop: the drain sets it, or a second signal, or the drain's time
    shutdown = Shutdown(args.shutdown_timeout, log, f"stage {args.stage_index}", force_stop=stop.set)
    starting = StartingStop().install()  # until it serves: nothing to drain, stop at once
    return starting.call(_start_and_serve, args, stop, shutdown)


def _start_and_serve(args: argparse.Namespace, stop: StageStop, shutdown) -> int:
    plan = plan_stage(args)
    pin_cores(args)
    forked = fork_followers(args)  # before the stage's own torch ops and threads (stage_worker.follower_start)
    pin_threads(args)
    worker = load_worker(args, plan, forked)
    describe(args, plan, worker)
    return serve(args, worker, plan, stop, shutdown)


def plan_stage(args: argparse.Namespace) -> StagePlan:
    """The model, the stage's layers and what they are served with, refused here if the flags do not fit."""
    from stage_worker.lora import LoRASettings
    from stage_worker.loading import check_layer_range
    from stagemesh.core.model_config import ModelConfig
    from stagemesh.core.model_source import resolve_source

    source = resolve_source(args.model, args.tokenizer, args.quantization, args.quantization_activations)
    cfg = ModelConfig.from_path(source.model_dir)
    start, end = stage_layers(args, cfg.num_hidden_layers)
    check_layer_range(cfg, start, end)
    cfg.check_tp_size(args.tensor_parallel_size)
    if args.enable_expert_parallel:
        cfg.check_expert_parallel(args.tensor_parallel_size)
    if args.standby and args.data_parallel_size > 1:
        raise StagemeshError("--standby with --data-parallel-size > 1 is not supported: an expert-parallel group "
                             "re-forms with the restarted member (stage_worker.ep_group)")
    check_kv_cache(args, cfg)
    plan = StagePlan(source, cfg, start, end, expert_parallel_across_replicas(args, cfg, start, end),
                     eplb_config(args, cfg), stage_speculation(args, cfg, end), LoRASettings.from_args(args))
    check_pooling(args, plan)
    if args.kv_offloading_disk_path:  # before the weights load: a bad directory is refused at once
        from stage_worker.kv_disk import check_writable

        check_writable(args.kv_offloading_disk_path)
    return plan


def check_pooling(args: argparse.Namespace, plan: StagePlan) -> None:
    """--runner pooling checked against the model before any weight is read, and said in the log."""
    from stagemesh.core.common_flags import PoolingOptions
    from stagemesh.core.flags import from_args

    options = from_args(PoolingOptions, args)
    pooler = options.resolve(plan.source.model_dir, plan.cfg.raw)
    if pooler is None:
        return
    if plan.spec is not None:
        raise StagemeshError("--speculative-config does not run with --runner pooling (a pooling request generates "
                             "nothing)")
    log.info("stage %d: --runner pooling --convert %s: %s pooling, tasks %s", args.stage_index, pooler.convert,
             pooler.pooling_type, ", ".join(pooler.tasks))


def check_kv_cache(args: argparse.Namespace, cfg) -> None:
    """--kv-cache-dtype and --calculate-kv-scales, refused before the weights load where they cannot serve."""
    from stage_worker.kv_cache import check_kv_cache_dtype
    from stagemesh.core.kv_cache_dtype import is_fp8

    check_kv_cache_dtype(args.kv_cache_dtype, cfg)
    if args.calculate_kv_scales and not is_fp8(args.kv_cache_dtype):
        raise StagemeshError("--calculate-kv-scales sets an fp8 KV cache's scales: it needs --kv-cache-dtype fp8 "
                             "(or fp8_e4m3, fp8_e5m2)")


def pin_cores(args: argparse.Namespace) -> None:
    """--cpu-affinity, before the followers start (they inherit it)."""
    if args.cpu_affinity:
        try:
            os.sched_setaffinity(0, {int(c) for c in args.cpu_affinity.split(",")})
        except (ValueError, OSError) as err:
            raise StagemeshError(f"--cpu-affinity {args.cpu_affinity!r}: {err}") from None


def fork_followers(args: argparse.Namespace) -> list:
    """The TP followers forked now, where the start method and the stage's state allow it; [] otherwise."""
    from stage_worker.follower_start import fork_followers as fork

    return fork(args.tensor_parallel_size * args.prefill_context_parallel_size)


def pin_threads(args: argparse.Namespace) -> None:
    """--threads, before the model loads."""
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)


def load_worker(args: argparse.Namespace, plan: StagePlan, forked: list):
    """The stage's worker, its weights loaded (and a standby's KV cache allocated). forked: its TP followers,
    forked already (stage_worker.follower_start), or [] to spawn them."""
    from stage_worker.settings import StageSettings
    from stage_worker.worker import StageConfig, StageWorker

    settings = StageSettings.from_flags(args, plan.source, (plan.start, plan.end))
    worker = StageWorker(StageConfig(settings, args.stage_index, handoff=args.handoff,
                                     kv_cache_memory=args.kv_cache_memory,
                                     gpu_memory_utilization=args.gpu_memory_utilization, ep=plan.ep,
                                     standby=args.standby, speculative=plan.spec,
                                     kv_offloading_disk_path=args.kv_offloading_disk_path,
                                     forked_followers=forked))
    if args.standby:  # warm: a join with the stage's own number of blocks finds its cache ready
        worker.runner.allocate_kv_cache(worker.num_kv_blocks)
    return worker


def describe(args: argparse.Namespace, plan: StagePlan, worker) -> None:
    """What the stage computes with, in its log (CPU path, quantization, adapters, experts), and its metrics."""
    from stage_worker.kv_tier_metrics import watch_kv_tiers

    i, source, lora = args.stage_index, plan.source, plan.lora
    internal_token.warn_if_open(f"stage {i}")
    if args.device == "cpu":
        from kernels import cpu_ops
        from stage_worker.cpu_isa import cpu_flags, describe_cpu_path, describe_isa

        built = cpu_ops.load() is not None
        log.info("stage %d: %s; %s", i, describe_cpu_path(str(worker.runner.dtype).removeprefix("torch."),
                                                          cpu_flags(), kernels=built), describe_isa(cpu_flags(), built))
    if worker.runner.quantization:  # the flag's, or the checkpoint's own quantization_config
        from stage_worker.quantization import describe as describe_quantization

        log.info("stage %d: --quantization %s%s: %s; activations %s", i, worker.runner.quantization,
                 f" from {source.gguf_file}" if source.gguf_file else "", describe_quantization(worker.runner.model),
                 worker.runner.activations)
    if lora is not None:
        log.info("stage %d: LoRA adapters %s (--max-loras %d, --max-lora-rank %d)", i,
                 ", ".join(m.name for m in lora.modules) or "none", lora.limits.max_loras, lora.limits.max_lora_rank)
    r = worker.runner
    log.info("stage %d: %s", i, describe_kv_cache(r, worker.kv_bytes_per_block, args.kv_cache_dtype))
    if args.decode_context_parallel_size > 1:
        log.info("stage %d: decode context parallel %d (--decode-context-parallel-size): each of %d group(s) of "
                 "%d TP ranks keeps %d KV head(s) per rank and %d of every block's %d tokens; %d blocks of "
                 "%d tokens hold %s tokens", i, args.decode_context_parallel_size,
                 args.tensor_parallel_size // args.decode_context_parallel_size, args.decode_context_parallel_size,
                 r.num_kv_heads, r.kv_block_size, r.block_size, worker.num_kv_blocks, r.block_size,
                 f"{worker.num_kv_blocks * r.block_size:,}")
    if args.prefill_context_parallel_size > 1:
        log.info("stage %d: prefill context parallel %d (--prefill-context-parallel-size): %d processes (TP %d x "
                 "PCP %d), each with its TP shard of the weights, computing and keeping %d of every block's %d tokens; "
                 "%d blocks of %d tokens hold %s tokens", i, r.tp.cp_size, r.tp.size, args.tensor_parallel_size,
                 r.tp.cp_size, r.kv_block_size, r.block_size, worker.num_kv_blocks, r.block_size,
                 f"{worker.num_kv_blocks * r.block_size:,}")
    if plan.cfg.is_moe:
        from stage_worker.moe import describe_layout
        from stage_worker.observe import watch_expert_load

        log.info("stage %d experts: %s", i, describe_layout(plan.cfg, args.tensor_parallel_size,
                                                            args.enable_expert_parallel, worker.ep))
        watch_expert_load(i, worker.runner.model)
    watch_kv_tiers(i, worker.tiers)


def describe_kv_cache(runner, bytes_per_block: int, flag: str) -> str:
    """The stage's KV cache in words: its dtype, its bytes per token over the stage's ranks, its scales."""
    dtype = str(runner.kv_cache_dtype).removeprefix("torch.")
    per_token = bytes_per_block // runner.block_size
    scales = runner.kv_scales
    if scales.source == "unused":
        return f"KV cache in {dtype} (--kv-cache-dtype {flag}), {per_token:,} bytes per token"
    how = {"checkpoint": "from the checkpoint", "default": "1.0 (the checkpoint has none)",
           "pending": "calculated from the first forward (--calculate-kv-scales)"}.get(scales.source, scales.source)
    values = f": {scales.summary()}" if scales.source == "checkpoint" else ""
    return f"KV cache in {dtype} (--kv-cache-dtype {flag}), {per_token:,} bytes per token, scales {how}{values}"


class StageStop(threading.Event):
    """The stage's stop: it ends the main loop, and (on_set: the step executor's abort) wakes a step that waits on
    another stage, for its activations or a step ahead's tokens over the grpc handoff. That stage may have
    stopped first (a drained replica's stages stop together), and the wait would hold the main thread, and the
    process, for up to DEADLINES.handoff_recv_s."""

    def __init__(self) -> None:
        super().__init__()
        self.on_set: list[Callable[[], None]] = []

    def set(self) -> None:
        super().set()
        for fn in self.on_set:
            fn()


def serve(args: argparse.Namespace, worker, plan: StagePlan, stop: StageStop, shutdown) -> int:
    """Serve until told to stop (0), or until the experts' group breaks (EXIT_BROKEN: the supervisor restarts
    the stage); the model's work runs on this thread, the one that loaded it."""
    from stage_worker.ep_group import BROKEN_LINGER_S, EXIT_BROKEN, EPGroupBroken
    from stage_worker.kv_connector import PeerStages
    from stage_worker.registration import start_heartbeat
    from stage_worker.service import ServerThread, StageServicer

    servicer = StageServicer(worker, "", PeerStages(args.scheduler))
    server = ServerThread(servicer, args.host, args.port)
    try:
        if worker.ep is not None:  # the replica is not whole until its experts' group is
            worker.ep.form()
        start_server(args, server, servicer, plan)
        shutdown.install()  # a drain: the replica takes no new work, the stage leaves once its work is done
        freeze_startup_heap("stage")
        worker.steps.start()  # from here on the model's work waits for the loop below
        stop.on_set.append(worker.steps.abort)
        failed = start_heartbeat(args.scheduler, servicer, stop, shutdown, server)
        worker.steps.run_until(stop, idle=worker.ep)
        if failed:
            raise failed[0]
    except EPGroupBroken as err:
        if stop.is_set():  # a member that stopped first, as the whole mesh stops
            log.info("stopping: %s", err)
            return 0
        log.error("%s", err)
        stop.wait(BROKEN_LINGER_S)  # a step the scheduler sends meanwhile gets this reason, not a refused connection
        return EXIT_BROKEN
    finally:
        server.stop(grace=1)
        worker.close()
    return 0


def start_server(args: argparse.Namespace, server, servicer, plan: StagePlan) -> None:
    port = server.start()
    servicer.address = f"{args.advertise_host or args.host}:{port}"
    log.info("stage %d serving layers %d:%d at %s (TP=%d, %s, %s handoff, %d KV blocks of %d tokens)",
             args.stage_index, plan.start, plan.end, servicer.address, args.tensor_parallel_size, args.device,
             args.handoff, servicer.worker.num_kv_blocks, args.block_size)


class StartingStop:
    """SIGTERM or SIGINT before the stage serves (its drain's handlers not yet installed): stop at once, exit 0.

    The handler raises SystemExit wherever the main thread is, which may be inside a library's import or a C
    extension's set-up, and that code may turn it into another error (numpy's: "cannot load module more than once
    per process"). So whatever unwinds once a stop was asked is the stop, not a failure: `call` returns 0."""

    def __init__(self) -> None:
        self.signum: int | None = None

    def install(self) -> "StartingStop":
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        return self

    def _on_signal(self, signum: int, _frame) -> None:
        if self.signum is not None:  # already unwinding: a second exception would only interrupt the clean-up
            return
        self.signum = signum
        log.info("signal %d during start-up: stopping", signum)
        raise SystemExit(0)

    def call(self, fn: Callable[..., int], *args) -> int:
        try:
            return fn(*args)
        except BaseException as err:
            if self.signum is None:
                raise
            log.info("stopped during start-up (%s unwound it)", type(err).__name__)
            return 0
