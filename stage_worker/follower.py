"""A TP follower of a stage: rank t > 0 of its TP group, one device.

Started by the stage's rank 0 (stage_worker.worker), which then tells it everything over one channel, its
stdin (stage_worker.control): first the stage's settings whole (stage_worker.settings, as JSON), then: join an
epoch, run a step (the StepBatch bytes the scheduler sent, with the tokens rank 0 filled in for a step run ahead),
read or write KV blocks, move experts, leave. The epoch's TP group carries the tensors.
"""
from __future__ import annotations

import ctypes
import json
import logging
import signal
import sys

import torch

from stagemesh.core.lora import LoRAError
from stagemesh.core.step_wire import epoch_from_pb, step_from_pb
from stagemesh.v1 import stage_pb2
from stage_worker import control, eplb, kv_transfer
from stage_worker import dist as sdist
from stage_worker.kv_disk import DiskTier
from stage_worker.kv_tier_ranks import TierFollower
from stage_worker.kv_tiers import KVTierStore, block_layout
from stage_worker.runner import StageRunner
from stage_worker.settings import StageSettings

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


def start_message(settings: StageSettings, tp_rank: int, kv_disk: tuple[str, str] | None = None) -> bytes:
    """What rank 0 tells TP rank `tp_rank` first, on its pipe (main() reads it): the stage's settings whole, as
    JSON. `kv_disk`: the disk tier's namespace directory and namespace, which rank 0 made and holds locked
    (stage_worker.kv_disk)."""
    start = {"settings": settings.to_dict(), "tp_rank": tp_rank, "kv_disk": kv_disk}
    return control.frame(control.START, 0, json.dumps(start).encode())


def read_start(channel: control.Reader) -> tuple[StageSettings, int, tuple[str, str] | None]:
    """The settings, rank and disk tier of start_message, the pipe's first message."""
    message = channel.read()
    if message is None or message[0] != control.START:
        raise SystemExit("the stage's rank 0 sent no START message (a follower is started by its stage)")
    start = json.loads(message[2])
    disk = start["kv_disk"]
    return (StageSettings.from_dict(start["settings"]), start["tp_rank"],
            None if disk is None else (disk[0], disk[1]))


def main(quiet_without_start: bool = False) -> None:
    """quiet_without_start: a follower forked before rank 0 knew it would need it (stage_worker.follower_start)
    ends without a word when rank 0 closes the pipe before its START (the stage refused its flags)."""
    die_with_parent()
    channel = control.Reader(sys.stdin.fileno())
    if quiet_without_start and channel.peek() is None:
        return
    settings, tp_rank, kv_disk = read_start(channel)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s follower tp{tp_rank} %(levelname)s: %(message)s")
    if settings.threads:
        torch.set_num_threads(settings.threads)
    runner = StageRunner(settings, tp_rank=tp_rank)
    disk = DiskTier(kv_disk[0], kv_disk[1], tp_rank, block_layout(runner)) if kv_disk is not None else None
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    serve(runner, channel, KVTierStore(runner, disk))


if __name__ == "__main__":
    main()
