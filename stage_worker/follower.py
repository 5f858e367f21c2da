"""A TP follower of a stage: rank t > 0 of its TP group, one device.

Started by the stage's rank 0 (stage_worker.worker). Control before a world
exists comes on stdin as length-prefixed JoinPipelineRequest protobufs; inside
an epoch, steps come broadcast over the TP group as the StepBatch bytes the
scheduler sent, with the tokens rank 0 filled in for a step run ahead.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import logging
import signal
import struct
import sys

import torch

from stagemesh.core.step import EpochSpec
from stagemesh.core.step_wire import epoch_from_pb, step_from_pb
from stagemesh.v1 import stage_pb2
from stage_worker import dist as sdist
from stage_worker import eplb, kv_transfer, run_ahead
from stage_worker.runner import SliceConfig, StageRunner

log = logging.getLogger("stagemesh.follower")


def die_with_parent() -> None:
    try:  # Linux: SIGKILL us when the stage's rank 0 goes, so no orphan keeps a device
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def read_message(stream) -> bytes | None:
    head = stream.read(4)
    if len(head) < 4:
        return None
    (size,) = struct.unpack("<I", head)
    return stream.read(size)


def serve_epoch(runner: StageRunner, join: EpochSpec) -> None:
    tp = runner.tp
    sdist.join_world(join, tp, runner.device)  # (the first stage's rank 0 fills in steps run ahead)
    runner.reset(join.num_kv_blocks)
    hidden_size = runner.config.hidden_size
    try:
        while True:
            kind, payload = sdist.recv_control(tp)
            if kind == sdist.LEAVE:
                return
            if kind in (kv_transfer.KV_EXPORT, kv_transfer.KV_IMPORT):  # rank 0 reads or writes whole KV blocks
                kv_transfer.follow(runner, kind, payload)
                continue
            if kind == eplb.EPLB_REBALANCE:  # rank 0 moved experts between the slots
                eplb.apply(runner, eplb.decode(payload, len(eplb.balanced_blocks(runner.model)), tp.size))
                continue
            filled, step_bytes = sdist.read_step_message(payload)
            step = step_from_pb(stage_pb2.StepBatch.FromString(step_bytes))
            if filled:  # a step run ahead: as rank 0 runs it
                run_ahead.fill(step, filled)
            hidden = None
            if not runner.is_first_stage:
                buf = torch.empty((step.num_tokens, hidden_size), dtype=runner.dtype, device=runner.device)
                hidden = sdist.broadcast_hidden(buf, tp)
            runner.execute(step, hidden)
    finally:
        sdist.leave_world(tp)


def follower_argv(slice_: SliceConfig, tp_rank: int, threads: int) -> list[str]:
    """The command line of TP rank `tp_rank` of `slice_` (main() reads it back)."""
    argv = ["--model", str(slice_.model_dir), "--layers", f"{slice_.layer_start}:{slice_.layer_end}",
            "--tp-rank", str(tp_rank), "--tp-size", str(slice_.tp_size), "--device", slice_.device,
            "--block-size", str(slice_.block_size), "--threads", str(threads)]
    if slice_.dtype:
        argv += ["--dtype", slice_.dtype]
    if slice_.expert_parallel:
        argv.append("--enable-expert-parallel")
    if slice_.quantization:
        argv += ["--quantization", slice_.quantization]
    if slice_.gguf_file:
        argv += ["--gguf-file", slice_.gguf_file]
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
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--enable-expert-parallel", action="store_true")
    p.add_argument("--eplb-config", default=None)
    p.add_argument("--quantization", default=None)
    p.add_argument("--gguf-file", default=None)
    args = p.parse_args()
    die_with_parent()
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s follower tp{args.tp_rank} %(levelname)s: %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    start, end = (int(x) for x in args.layers.split(":"))
    balance = eplb.EPLBConfig(**json.loads(args.eplb_config)) if args.eplb_config else None  # checked by rank 0
    runner = SliceConfig(args.model, start, end, args.tp_size, args.device, args.dtype, args.block_size,
                         expert_parallel=args.enable_expert_parallel, eplb=balance, quantization=args.quantization,
                         gguf_file=args.gguf_file).runner(args.tp_rank)
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    while (raw := read_message(sys.stdin.buffer)) is not None:
        join = epoch_from_pb(stage_pb2.JoinPipelineRequest.FromString(raw))
        try:
            serve_epoch(runner, join)
        except Exception as err:  # the epoch broke (a peer died): wait for the next one
            log.warning("epoch %d ended: %s", join.epoch, err)


if __name__ == "__main__":
    main()
