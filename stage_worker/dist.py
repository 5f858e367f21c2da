"""The replica's torch.distributed world of one epoch.

Every rank of every stage joins one world per epoch through the store the
scheduler hosts; each stage's TP group is a subgroup, which carries tensors
only: what a TP follower is to do comes from rank 0 over stage_worker.control.
"""
from __future__ import annotations

import os
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist

from stagemesh.core.deadlines import DEADLINES
from stagemesh.core.step import EpochSpec
from stage_worker.parallel import TPGroup

# a join whose peers never come (the scheduler gave up on a stage mid-form) gives up this soon, so that the
# next JoinPipeline, which waits behind it, is not held up for long
STORE_TIMEOUT = timedelta(seconds=DEADLINES.store_s)
GROUP_TIMEOUT = timedelta(seconds=DEADLINES.collective_s)
SHM_DIR = "/dev/shm"
SHM_SLOT_BYTES = 16 * 2**20  # the largest tensor a shared-memory collective carries; larger ones take gloo


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def join_world(req: EpochSpec, tp: TPGroup, device: torch.device) -> int:
    """Join the epoch's world and set up `tp`'s collectives in place (the model's layers hold
    that object); returns this process's global rank."""
    leave_world(tp)
    store = dist.PrefixStore(f"epoch-{req.epoch}/",
                             dist.TCPStore(req.store_host, req.store_port, is_master=False, timeout=STORE_TIMEOUT))
    rank = req.rank_offset + tp.rank
    dist.init_process_group(backend_for(device), store=store, rank=rank, world_size=req.world_size,
                            timeout=GROUP_TIMEOUT)
    start = 0
    for size in req.tp_sizes:  # every rank creates every group, in the same order
        group = dist.new_group(list(range(start, start + size)))
        if start <= rank < start + size:
            tp.group, tp.src = group, start
        start += size
    if tp.size > 1 and device.type == "cpu":
        tp.shm = attach_shm(store, f"tp-shm-{tp.src}", tp)
    if tp.shard is not None and tp.shard.size > 1:
        join_shard_group(tp, store if device.type == "cpu" else None)
    return rank


def join_shard_group(tp: TPGroup, store=None) -> None:
    """A PCP stage's TP group of this rank (tp.shard: the ranks of the same place in each PCP group), formed by its
    members alone (the other stages' ranks know nothing of a stage's PCP); `store`: its shared-memory
    collectives, on a CPU."""
    shard, members = tp.shard, shard_members(tp)
    assert shard is not None
    shard.group = dist.new_group(members, use_local_synchronization=True)
    shard.src = members[0]
    if store is not None:
        shard.shm = attach_shm(store, f"tp-shm-{tp.src}-pcp-{tp.cp_rank}", shard)


def shard_members(tp: TPGroup) -> list[int]:
    """The global ranks of tp.shard's group: rank cp_rank of each PCP group of the stage."""
    assert tp.shard is not None
    return [tp.src + t * tp.cp_size + tp.cp_rank for t in range(tp.shard.size)]


def attach_shm(store, key: str, tp: TPGroup):
    """Shared-memory collectives for a CPU TP group (one host: the followers are the stage's
    children). TP rank 0 makes the file in /dev/shm and names it in the store; it is unlinked
    once every rank has mapped it. None (gloo then) without the CPU kernels or room in /dev/shm."""
    from kernels import cpu_ops

    ops = cpu_ops.load()
    slot_bytes = SHM_SLOT_BYTES
    try:  # /dev/shm may be small (64 MiB in a container by default): slots must fit it
        fs = os.statvfs(SHM_DIR)
        slot_bytes = min(slot_bytes, fs.f_bavail * fs.f_frsize // (4 * tp.size))
    except OSError:
        slot_bytes = 0
    usable = torch.tensor([int(ops is not None and slot_bytes >= 2**20), slot_bytes], dtype=torch.int64)
    dist.all_reduce(usable, op=dist.ReduceOp.MIN, group=tp.group)  # every rank agrees, or none uses it
    if not usable[0]:
        return None
    slot_bytes = int(usable[1])
    if tp.rank == 0:
        fd, path = tempfile.mkstemp(prefix="stagemesh-tp-", dir=SHM_DIR)
        os.ftruncate(fd, ops.ShmComm.file_bytes(tp.size, slot_bytes))
        os.close(fd)
        store.set(key, path)
    else:
        path = store.get(key).decode()
    comm = ops.ShmComm(path, tp.rank, tp.size, slot_bytes, GROUP_TIMEOUT.total_seconds())
    dist.barrier(group=tp.group)
    if tp.rank == 0:
        os.unlink(path)
    return comm


def leave_world(tp: TPGroup | None = None) -> None:
    if tp is not None:
        tp.group = tp.shm = None
        if tp.shard is not None:
            tp.shard.group = tp.shard.shm = None
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # a broken world (a peer died) still has to go
            pass


def broadcast_hidden(hidden: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    # collectives move device tensors on NCCL, CPU tensors on gloo or shared memory: hidden lives on the stage's device
    return tp.broadcast(hidden)
