"""The replica's torch.distributed world of one epoch, and control traffic over it.

Every rank of every stage joins one world per epoch through the store the
scheduler hosts; each stage's TP group is a subgroup. Step metadata reaches TP
followers as protobuf bytes broadcast over the TP group (never pickled).
"""
from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from stagemesh.v1 import stage_pb2

FORWARD, LEAVE = 1, 2
STORE_TIMEOUT = timedelta(seconds=60)
GROUP_TIMEOUT = timedelta(seconds=120)


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def join_world(req: stage_pb2.JoinPipelineRequest, tp_rank: int, device: torch.device):
    """Join the epoch's world; returns (global rank, this stage's TP group)."""
    leave_world()
    store = dist.TCPStore(req.store_host, req.store_port, is_master=False, timeout=STORE_TIMEOUT)
    rank = req.rank_offset + tp_rank
    dist.init_process_group(backend_for(device), store=dist.PrefixStore(f"epoch-{req.epoch}/", store), rank=rank,
                            world_size=req.world_size, timeout=GROUP_TIMEOUT)
    mine, start = None, 0
    for size in req.tp_sizes:  # every rank creates every group, in the same order
        group = dist.new_group(list(range(start, start + size)))
        if start <= rank < start + size:
            mine = group
        start += size
    return rank, mine


def leave_world() -> None:
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # a broken world (a peer died) still has to go
            pass


def send_control(kind: int, payload: bytes, src: int, group) -> None:
    header = torch.tensor([kind, len(payload)], dtype=torch.int64)
    dist.broadcast(header, src=src, group=group)
    if payload:
        dist.broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8), src=src, group=group)


def recv_control(src: int, group) -> tuple[int, bytes]:
    header = torch.empty(2, dtype=torch.int64)
    dist.broadcast(header, src=src, group=group)
    kind, size = header.tolist()
    if not size:
        return kind, b""
    payload = torch.empty(size, dtype=torch.uint8)
    dist.broadcast(payload, src=src, group=group)
    return kind, payload.numpy().tobytes()


def broadcast_hidden(hidden: torch.Tensor, src: int, group) -> torch.Tensor:
    # collectives move device tensors on NCCL, CPU tensors on gloo: hidden already lives on the stage's device
    dist.broadcast(hidden, src=src, group=group)
    return hidden
