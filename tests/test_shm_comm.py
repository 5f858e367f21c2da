"""Shared-memory collectives of a CPU TP group (kernels/csrc/shm_comm.cpp), between real processes."""
from __future__ import annotations

import multiprocessing as mp
import os
import tempfile

import pytest
import torch

from kernels import cpu_ops

if cpu_ops.load() is None:
    pytest.skip("the CPU kernels could not be built here (no C++ compiler?)", allow_module_level=True)

SLOT = 1 << 20


def _rank(path: str, rank: int, world: int, results, die_before: int | None = None) -> None:
    torch.manual_seed(rank)
    comm = cpu_ops.load().ShmComm(path, rank, world, SLOT, 20.0)
    try:
        out = {}
        for step in range(50):  # many rounds: both buffers are reused many times
            if die_before is not None and step == die_before:
                os._exit(0)
            x = torch.full((3, 5), float(rank + step))
            comm.all_reduce(x)
            out.setdefault("sums", []).append(x[0, 0].item())
        b = torch.arange(7, dtype=torch.int64) if rank == 0 else torch.zeros(7, dtype=torch.int64)
        comm.broadcast(b, 0)
        out["broadcast"] = b.tolist()
        out["gathered"] = comm.all_gather(torch.full((2,), float(rank))).tolist()
        out["ok"] = True
        results.put((rank, out))
    except Exception as err:  # noqa: BLE001 - the parent asserts on the message
        results.put((rank, {"error": str(err)}))


def _group_file(world: int) -> str:
    fd, path = tempfile.mkstemp(prefix="stagemesh-test-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    os.ftruncate(fd, cpu_ops.load().ShmComm.file_bytes(world, SLOT))
    os.close(fd)
    return path


def _run(world: int, die: dict[int, int] | None = None) -> dict[int, dict]:
    ctx = mp.get_context("spawn")
    path = _group_file(world)
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(path, r, world, results, (die or {}).get(r))) for r in range(world)]
    try:
        for p in procs:
            p.start()
        got = {}
        for _ in range(world - len(die or {})):
            rank, out = results.get(timeout=60)
            got[rank] = out
        return got
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        os.unlink(path)


@pytest.mark.parametrize("world", [2, 3])
def test_all_reduce_broadcast_all_gather(world):
    got = _run(world)
    for rank in range(world):
        out = got[rank]
        assert out["sums"] == [float(sum(r + step for r in range(world))) for step in range(50)]
        assert out["broadcast"] == list(range(7))
        assert out["gathered"] == [[float(r)] * 2 for r in range(world)]


def test_a_rank_that_dies_is_named():
    got = _run(2, die={1: 10})
    assert "TP rank 1" in got[0]["error"] and "is gone" in got[0]["error"]
