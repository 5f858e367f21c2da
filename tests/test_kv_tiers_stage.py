"""The KV tiers through a real TP=2 stage (rank 0 and a follower process): StoreKV / LoadKV round-trip the blocks
on both ranks (compared through ReadKV, which gathers every KV head), through host memory and disk; the disk
tier's blocks come back in a later join's reply; bad arguments are INVALID_ARGUMENT; a second stage on the same
namespace directory and an unwritable directory are refused at start-up with exit code 2."""
from __future__ import annotations

import subprocess
import sys
import time
from datetime import timedelta

import grpc
import pytest
import torch.distributed as dist

from mesh import free_port, internal_channel
from stagemesh.core import kv_ticket
from stagemesh.core.sampling_params import SamplingParams
from stagemesh.core.wire import sampling_to_pb
from stagemesh.v1 import stage_pb2, stage_pb2_grpc

pytestmark = pytest.mark.slow
INVALID = grpc.StatusCode.INVALID_ARGUMENT
HOST_SLOTS, KV_BLOCKS = 4, 16
READ_KEY = b"k" * 32  # (the test joins the stage as its scheduler would: with a read key)


def stage_cmd(model, port: int, disk, tp: int = 2, extra: tuple[str, ...] = ()) -> list[str]:
    return [sys.executable, "-m", "stagemesh", "stage", str(model), "--scheduler", f"127.0.0.1:{free_port()}",
            "--stage-index", "0", "--layers", "0:4", "--tensor-parallel-size", str(tp), "--port", str(port),
            "--threads", "1", "--kv-cache-memory", str(2**20), "--kv-offloading-disk-path", str(disk), *extra]


def wait_up(stub, proc, timeout: float = 90) -> stage_pb2.StageDescription:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        assert proc.poll() is None, f"the stage exited with {proc.returncode}"
        try:
            return stub.Describe(stage_pb2.DescribeRequest(), timeout=2)
        except grpc.RpcError:
            time.sleep(0.3)
    raise TimeoutError("the stage did not come up")


@pytest.fixture(scope="module")
def stage(tiny_model_dir, tmp_path_factory):
    yield from running_stage(tiny_model_dir("llama"), tmp_path_factory)


def running_stage(model, tmp_path_factory, extra: tuple[str, ...] = ()):
    """(stub, description, store port, disk directory, process) of a TP=2 stage, stopped after."""
    disk = tmp_path_factory.mktemp("kv-disk")
    port = free_port()
    log = open(tmp_path_factory.mktemp("logs") / "stage.log", "wb")
    proc = subprocess.Popen(stage_cmd(model, port, disk, extra=extra), stdout=log, stderr=subprocess.STDOUT)
    channel = internal_channel(f"127.0.0.1:{port}")
    stub = stage_pb2_grpc.StageStub(channel)
    store_port = free_port()
    store = dist.TCPStore("127.0.0.1", store_port, is_master=True, timeout=timedelta(seconds=60))
    try:
        desc = wait_up(stub, proc)
        yield stub, desc, store_port, disk, proc
    finally:
        channel.close()
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        del store
        log.close()


def join(stub, store_port: int, epoch: int) -> stage_pb2.JoinPipelineResponse:
    return stub.JoinPipeline(stage_pb2.JoinPipelineRequest(
        epoch=epoch, store_host="127.0.0.1", store_port=store_port, world_size=2, rank_offset=0, tp_sizes=[2],
        num_kv_blocks=KV_BLOCKS, max_model_len=64, max_num_batched_tokens=64, num_host_kv_blocks=HOST_SLOTS,
        kv_read_key=READ_KEY), timeout=60)


def prefill(stub, epoch: int) -> None:
    """20 tokens into blocks 3 and 4."""
    tokens = list(range(5, 25))
    step = stage_pb2.StepBatch(step_id=0, chunks=stage_pb2.ScheduledChunks(
        seq_ids=[1], num_tokens=[20], token_ids=tokens, start_positions=[0], num_new_blocks=[2], new_block_ids=[3, 4],
        sample=[True]))
    step.new_sequences.add(seq_id=1, prompt_token_ids=tokens, sampling=sampling_to_pb(SamplingParams(max_tokens=4)))
    stub.Forward(stage_pb2.ForwardRequest(epoch=epoch, step=step), timeout=60)


def read(stub, epoch: int, block_ids: list[int]) -> list[tuple[int, int, bytes, bytes]]:
    return [(c.layer, c.first_block, c.k, c.v) for c in stub.ReadKV(stage_pb2.ReadKVRequest(
        epoch=epoch, block_ids=block_ids, layer_start=0, layer_end=4,
        ticket=kv_ticket.ticket(READ_KEY, epoch, block_ids)), timeout=30)]


def contents(stub, epoch: int, block: int) -> list[tuple[bytes, bytes]]:
    return [(k, v) for _, _, k, v in read(stub, epoch, [block])]


def test_store_and_load_round_trip_on_both_ranks_through_host_and_disk(stage):
    stub, desc, store_port, disk, _ = stage
    assert desc.kv_disk_tier and desc.kv_bytes_per_block == 2 * 4 * 16 * 2 * 16 * 4  # k+v, layers, tokens, heads
    round_trip(stub, desc, store_port, disk)


@pytest.fixture
def dcp_stage(tiny_model_dir, tmp_path_factory):
    yield from running_stage(tiny_model_dir("llama"), tmp_path_factory, ("--decode-context-parallel-size", "2"))


def test_under_dcp_each_rank_stores_and_loads_its_share_of_the_tokens(dcp_stage):
    """-tp 2 -dcp 2: each rank holds both KV heads and 8 of each block's 16 tokens (block 4 of the prefill's 20
    tokens lies on rank 0 only); ReadKV gives the whole blocks, so equal reads mean both shares came back."""
    stub, desc, store_port, disk, _ = dcp_stage
    # over both ranks: k+v, layers, 8 tokens, both heads, on each: the same bytes as TP=2 without DCP
    assert desc.kv_disk_tier and desc.kv_bytes_per_block == 2 * (2 * 4 * 8 * 2 * 16 * 4)
    round_trip(stub, desc, store_port, disk)


def round_trip(stub, desc, store_port: int, disk) -> None:
    assert list(join(stub, store_port, 1).disk_block_hashes) == []
    prefill(stub, 1)
    original = {b: contents(stub, 1, b) for b in (3, 4)}
    empty = contents(stub, 1, 9)
    # whole blocks on the wire, whatever the ranks keep: per layer k and v of 16 tokens x 2 heads x 16 fp32
    assert len(original[3]) == 4 and all(len(k) == len(v) == 16 * 2 * 16 * 4 for k, v in original[3])
    assert original[3] != empty
    stub.StoreKV(stage_pb2.StoreKVRequest(epoch=1, block_ids=[3, 4], host_slots=[0, 2], block_hashes=[0xA3, 2**64 - 1],
                                          to_disk=[True, True]), timeout=30)
    reply = stub.LoadKV(stage_pb2.LoadKVRequest(epoch=1, block_ids=[8, 9, 10], host_slots=[0, 2, 1],
                                                block_hashes=[0xA3, 2**64 - 1, 0xA3]), timeout=30)
    assert list(reply.loaded) == [True, True, False] and reply.bytes == 2 * desc.kv_bytes_per_block // 2
    assert contents(stub, 1, 8) == original[3] and contents(stub, 1, 9) == original[4]
    assert contents(stub, 1, 10) == empty  # the slot holds another block: nothing written
    # the disk tier: written in the background, then read back on both ranks
    deadline = time.monotonic() + 10
    while len(list(disk.glob("*/rank1/*.kv"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    reply = stub.LoadKV(stage_pb2.LoadKVRequest(epoch=1, block_ids=[11, 12, 13], host_slots=[-1, -1, -1],
                                                block_hashes=[0xA3, 2**64 - 1, 0x77]), timeout=30)
    assert list(reply.loaded) == [True, True, False]
    assert contents(stub, 1, 11) == original[3] and contents(stub, 1, 12) == original[4]
    # a file only one rank holds is loaded on neither
    next(disk.glob("*/rank1/*00a3.kv")).unlink()
    reply = stub.LoadKV(stage_pb2.LoadKVRequest(epoch=1, block_ids=[14], host_slots=[-1], block_hashes=[0xA3]),
                        timeout=30)
    assert list(reply.loaded) == [False] and contents(stub, 1, 14) == empty
    # the next join lists what every rank holds
    assert list(join(stub, store_port, 2).disk_block_hashes) == [2**64 - 1]


BAD = [
    ("StoreKV", dict(block_ids=[1, 2], host_slots=[0], block_hashes=[1, 2], to_disk=[False, False]), "one entry"),
    ("StoreKV", dict(block_ids=[KV_BLOCKS], host_slots=[0], block_hashes=[1], to_disk=[False]), "block ids below"),
    ("StoreKV", dict(block_ids=[1], host_slots=[HOST_SLOTS], block_hashes=[1], to_disk=[False]), "host slots"),
    ("StoreKV", dict(block_ids=[1], host_slots=[-1], block_hashes=[1], to_disk=[False]), "host slots"),
    ("StoreKV", dict(block_ids=[1, 2], host_slots=[0, 0], block_hashes=[1, 2], to_disk=[False, False]), "twice"),
    ("StoreKV", dict(disk_evictions=list(range(70000))), "disk evictions"),
    ("StoreKV", dict(block_ids=list(range(KV_BLOCKS + 1)), host_slots=[0] * (KV_BLOCKS + 1),
                     block_hashes=[1] * (KV_BLOCKS + 1), to_disk=[False] * (KV_BLOCKS + 1)), "up to"),
    ("LoadKV", dict(block_ids=[1], host_slots=[-2], block_hashes=[1]), "host slots"),
    ("LoadKV", dict(block_ids=[-1], host_slots=[0], block_hashes=[1]), "block ids below"),
    ("LoadKV", dict(block_ids=[1, 1], host_slots=[0, 1], block_hashes=[1, 2]), "twice"),
    ("LoadKV", dict(block_ids=[1], host_slots=[0, 1], block_hashes=[1]), "one entry"),
]


@pytest.fixture(scope="module")
def joined(stage) -> int:
    stub, _, store_port, _, _ = stage
    join(stub, store_port, 3)
    return 3


@pytest.mark.parametrize("method,fields,words", BAD, ids=[f"{m}-{w}-{i}" for i, (m, _, w) in enumerate(BAD)])
def test_bad_tier_calls_are_invalid_arguments(stage, joined, method, fields, words):
    stub, _, _, _, proc = stage
    epoch = joined
    request = getattr(stage_pb2, f"{method}Request")(epoch=epoch, **fields)
    with pytest.raises(grpc.RpcError) as err:
        getattr(stub, method)(request, timeout=30)
    assert err.value.code() == INVALID and words in err.value.details(), err.value.details()
    assert proc.poll() is None


def test_a_second_stage_on_the_same_directory_is_refused(stage, tiny_model_dir):
    _, _, _, disk, _ = stage
    second = subprocess.run(stage_cmd(tiny_model_dir("llama"), free_port(), disk), capture_output=True, text=True,
                            timeout=120)
    assert second.returncode == 2, second.stderr[-2000:]
    assert "in use by another stage" in second.stderr and str(disk) in second.stderr


def test_an_unwritable_directory_is_refused_at_start_up(tiny_model_dir, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    proc = subprocess.run(stage_cmd(tiny_model_dir("llama"), free_port(), blocker / "kv", tp=1), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and f"{blocker}/kv" in proc.stderr, proc.stderr[-2000:]
