"""A TP follower of a stage: rank t > 0 of its TP group, one device.

Started by the stage's rank 0 (stage_worker.worker), which then tells it everything over one channel, its
stdin (stage_worker.control): join an epoch, run a step (the StepBatch bytes the scheduler sent, with the
tokens rank 0 filled in for a step run ahead), read or write KV blocks, move experts, leave. The epoch's TP
group carries the tensors.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import logging
import signal
import sys

import torch

from stagemesh.core.common_flags import LoRAOptions, PoolingOptions
from stagemesh.core.flags import add_flags, from_args
from stagemesh.core.lora import LoRAError
from stagemesh.core.step_wire import epoch_from_pb, step_from_pb
from stagemesh.v1 import stage_pb2
from stage_worker import control, eplb, kv_transfer
from stage_worker import dist as sdist
from stage_worker.kv_disk import DiskTier
from stage_worker.kv_tier_ranks import TierFollower
from stage_worker.kv_tiers import KVTierStore, block_layout
from stage_worker.lora import LoRASettings
from stage_worker.runner import SliceConfig, StageRunner

log = logging.getLogger("stagemesh.follower")


def die_with_parent() -> None:
    try:  # Linux: SIGKILL us when the stage's rank 0 goes, so no orphan keeps a device
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def serve(runner: StageRunner, channel: control.Reader, tiers: KVTierStore | None = None) -> None:
    """Rank 0's messages in order, until it closes the pipe."""
    tiered = None if tiers is None else TierFollower(tiers)
    epoch = None  # the epoch this rank is in
    while (message := channel.read()) is not None:
        kind, of_epoch, payload = message
        if kind in (control.LORA_LOAD, control.LORA_UNLOAD):
            lora_message(runner, kind, payload)
            continue
        if kind != control.JOIN and of_epoch != epoch:
            continue  # the rest of an epoch this rank has left, or that broke under it
        try:
            if kind == control.JOIN:
                epoch = None
                join = epoch_from_pb(stage_pb2.JoinPipelineRequest.FromString(payload))
                sdist.join_world(join, runner.tp, runner.device)  # leaves the world it was in first
                runner.reset(join.num_kv_blocks)
                tiered = tiered or TierFollower(KVTierStore(runner))
                tiered.reset()
                tiered.tiers.resize(join.num_host_kv_blocks)
                epoch = of_epoch
            elif kind == control.LEAVE:
                epoch = None
                sdist.leave_world(runner.tp)
            elif kind in (control.KV_TIER_STORE, control.KV_TIER_READ, control.KV_TIER_FILL) and tiered is not None:
                tiered.handle(runner, kind, payload)
            else:
                run(runner, kind, payload)
        except Exception as err:  # the epoch broke (a peer died): wait for the next one
            log.warning("epoch %d ended: %s", of_epoch, err)
            epoch = None
            sdist.leave_world(runner.tp)


def lora_message(runner: StageRunner, kind: int, payload: bytes) -> None:
    """An adapter rank 0 loaded (and checked) or unloaded at run time: this rank's shard of it too. A failure is
    logged; a step that uses the adapter then fails here, which breaks the epoch as any failed step does."""
    spec = json.loads(payload)
    try:
        if runner.lora is None:
            raise LoRAError("this rank runs without --enable-lora")
        if kind == control.LORA_LOAD:
            runner.lora.add(spec["name"], spec["path"])
        else:
            runner.lora.remove(spec["name"])
    except LoRAError as err:
        log.error("LoRA adapter %r: %s", spec.get("name"), err)


def run(runner: StageRunner, kind: int, payload: bytes) -> None:
    """What rank 0 does beside this rank in the epoch: a step, a KV read or write, an EPLB move."""
    if kind in (control.KV_EXPORT, control.KV_IMPORT):  # rank 0 reads or writes whole KV blocks
        kv_transfer.follow(runner, kind, payload)
    elif kind == control.EPLB_REBALANCE:  # rank 0 moved experts between the slots
        eplb.apply(runner, eplb.decode(payload, len(eplb.balanced_blocks(runner.model)), runner.tp.size))
    elif kind == control.FORWARD:
        filled, step_bytes = control.read_step_message(payload)
        step = step_from_pb(stage_pb2.StepBatch.FromString(step_bytes))
        if filled:  # a step run ahead: as rank 0 runs it
            step.chunks.fill_placeholders(filled)
        hidden = None
        if not runner.is_first_stage:
            buf = torch.empty((step.num_tokens, runner.config.hidden_size), dtype=runner.dtype, device=runner.device)
            hidden = sdist.broadcast_hidden(buf, runner.tp)
        runner.execute(step, hidden)
    else:
        raise ValueError(f"control message of unknown kind {kind}")


def follower_argv(slice_: SliceConfig, tp_rank: int, threads: int, kv_disk: tuple[str, str] | None = None
                  ) -> list[str]:
    """The command line of TP rank `tp_rank` of `slice_` (main() reads it back). `kv_disk`: the disk tier's
    namespace directory and namespace, which rank 0 made and holds locked (stage_worker.kv_disk)."""
    argv = ["--model", str(slice_.model_dir), "--layers", f"{slice_.layer_start}:{slice_.layer_end}",
            "--tp-rank", str(tp_rank), "--tp-size", str(slice_.tp_size), "--device", slice_.device,
            "--block-size", str(slice_.block_size), "--dcp-size", str(slice_.dcp_size),
            "--pcp-size", str(slice_.pcp_size), "--threads", str(threads)]
    if slice_.dtype:
        argv += ["--dtype", slice_.dtype]
    if slice_.expert_parallel:
        argv.append("--enable-expert-parallel")
    if slice_.quantization:
        argv += ["--quantization", slice_.quantization]
    if slice_.gguf_file:
        argv += ["--gguf-file", slice_.gguf_file]
    if slice_.quantization_activations:
        argv += ["--quantization-activations", slice_.quantization_activations]
    if slice_.kv_cache_dtype:
        argv += ["--kv-cache-dtype", slice_.kv_cache_dtype]
    if slice_.calculate_kv_scales:
        argv.append("--calculate-kv-scales")
    if kv_disk is not None:
        argv += ["--kv-disk-dir", kv_disk[0], "--kv-namespace", kv_disk[1]]
    if slice_.lora is not None:
        argv += slice_.lora.argv()
    if slice_.pooling is not None:
        argv += slice_.pooling.argv()
    return argv + eplb.config_argv(slice_.eplb)


def main() -> None:
    p = argparse.ArgumentParser(description="TP follower of a stagemesh stage (started by the stage)")
    p.add_argument("--model", required=True)
    p.add_argument("--layers", required=True)
    p.add_argument("--tp-rank", type=int, required=True)
    p.add_argument("--tp-size", type=int, required=True)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dcp-size", type=int, default=1)
    p.add_argument("--pcp-size", type=int, default=1)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--enable-expert-parallel", action="store_true")
    p.add_argument("--eplb-config", default=None)
    p.add_argument("--quantization", default=None)
    p.add_argument("--gguf-file", default=None)
    p.add_argument("--kv-cache-dtype", default=None)
    p.add_argument("--calculate-kv-scales", action="store_true")
    p.add_argument("--quantization-activations", default=None)
    p.add_argument("--kv-disk-dir", default=None)
    p.add_argument("--kv-namespace", default=None)
    add_flags(p, LoRAOptions)
    add_flags(p, PoolingOptions)
    args = p.parse_args()
    die_with_parent()
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s follower tp{args.tp_rank} %(levelname)s: %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    start, end = (int(x) for x in args.layers.split(":"))
    balance = eplb.EPLBConfig(**json.loads(args.eplb_config)) if args.eplb_config else None  # checked by rank 0
    runner = SliceConfig(args.model, start, end, args.tp_size, args.device, args.dtype, args.block_size,
                         dcp_size=args.dcp_size, pcp_size=args.pcp_size, expert_parallel=args.enable_expert_parallel,
                         eplb=balance, quantization=args.quantization,
                         quantization_activations=args.quantization_activations,
                         gguf_file=args.gguf_file, lora=LoRASettings.from_args(args),
                         pooling=from_args(PoolingOptions, args), kv_cache_dtype=args.kv_cache_dtype,
                         calculate_kv_scales=args.calculate_kv_scales).runner(args.tp_rank)
    disk = DiskTier(args.kv_disk_dir, args.kv_namespace, args.tp_rank, block_layout(runner)) if args.kv_disk_dir \
        else None
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    serve(runner, control.Reader(sys.stdin.fileno()), KVTierStore(runner, disk))


if __name__ == "__main__":
    main()
