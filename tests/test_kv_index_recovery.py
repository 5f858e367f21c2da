"""The router's KV index recovers (issue 44): the KV event stream is numbered (an epoch per cache, a seq per
batch), a gap or a new epoch without its snapshot makes the router resync that replica, which is degraded
(its hits count for nothing) until the snapshot is in; the index knows the tiers (device, host, disk) and
weighs a hit by them; a flood cannot grow it past a cap. Then real processes: a dropped batch and a router
restart both end with the router's index equal to the replica's own view (GetKVSnapshot)."""
from __future__ import annotations

import asyncio
import re
import time
from dataclasses import dataclass

import pytest

from router.kv_index import CAP_SLACK, KVAware, KVFeed, KVIndex
from scheduler.block_manager import BlockManager
from scheduler.kv_events import DROP_SEQ_ENV, AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, KVEventHub
from scheduler.replies import kv_batch_to_pbs
from stagemesh.core.engine_request import EngineRequest
from stagemesh.core.block_hash import chain_hash, prefix_hashes

BS = 4


@dataclass
class FakeReplica:
    address: str
    load: int = 0


class TieredBlockManager(BlockManager):
    """A block manager with a host tier beside its pool (what scheduler/tiers.py will add)."""
    host: list[int] = []

    def snapshot_hashes(self):
        return [*super().snapshot_hashes(), ("host", list(self.host))]


def fill(kv: BlockManager, request_id: str, tokens: list[int]) -> list[int]:
    kv.allocate(request_id, len(tokens))
    kv.cache_full_blocks(request_id, tokens, len(tokens))
    return prefix_hashes(tokens, BS)


def pb(batch: KVEventBatch, limit: int = 200_000):
    return kv_batch_to_pbs(batch, BS, limit)


# -- the source: numbered batches, snapshots of every tier ------------------------------------------------

def test_the_hub_numbers_its_batches_and_every_snapshot_says_which_seq_it_is_consistent_with():
    async def go():
        first = TieredBlockManager(8, BS)
        first.host = [111, 222]
        h = fill(first, "a", list(range(8)))
        current = {"kv": first}
        hub = KVEventHub(lambda: current["kv"], tick_s=0.01)
        q1 = hub.subscribe()
        snap = await q1.get()
        assert snap.snapshot and snap.epoch == hub.epoch != 0 and snap.seq == 1  # (the epoch's first batch)
        assert snap.events == [AllBlocksCleared(), BlockStored(h, None), BlockStored([111, 222], None, medium="host")]
        fill(first, "b", [9, 9, 9, 9])
        batch = await asyncio.wait_for(q1.get(), 1)
        assert (batch.epoch, batch.seq, batch.snapshot) == (snap.epoch, 2, False)
        q2 = hub.subscribe()  # a second subscriber's snapshot: consistent with seq 2, the next batch is 3
        snap2 = await q2.get()
        assert (snap2.epoch, snap2.seq, snap2.snapshot) == (snap.epoch, 2, True)
        assert hub.snapshot() == (snap.epoch, 2, [("device", [*h, chain_hash(None, [9, 9, 9, 9])]),
                                                  ("host", [111, 222])])
        fill(first, "c", [7, 7, 7, 7])
        b1, b2 = await asyncio.wait_for(q1.get(), 1), await asyncio.wait_for(q2.get(), 1)
        assert b1 is b2 and b1.seq == 3
        current["kv"] = BlockManager(8, BS)  # the cache starts over: a new epoch, its first batch a snapshot
        batch = await asyncio.wait_for(q1.get(), 1)
        assert batch.snapshot and batch.seq == 1 and batch.epoch not in (0, snap.epoch)
        assert batch.events == [AllBlocksCleared()]
        hub.unsubscribe(q1)
        hub.unsubscribe(q2)
        await asyncio.sleep(0.05)
        assert hub._task is None and hub.snapshot()[:2] == (0, 0)  # nobody follows: no position to give

    asyncio.run(go())


def test_the_test_hook_drops_one_batch_but_counts_it(monkeypatch):
    monkeypatch.setenv(DROP_SEQ_ENV, "3")

    async def go():
        kv = BlockManager(16, BS)
        hub = KVEventHub(lambda: kv, tick_s=0.01)
        queue = hub.subscribe()
        seqs = [(await queue.get()).seq]
        for i in range(3):
            fill(kv, f"r{i}", [i] * 4)
            await asyncio.sleep(0.05)
        while not queue.empty():
            seqs.append(queue.get_nowait().seq)
        assert seqs == [1, 2, 4]
        hub.unsubscribe(queue)

    asyncio.run(go())


def test_a_large_batch_goes_as_parts_that_rebuild_the_same_index():
    tokens = list(range(4 * 50))
    h = prefix_hashes(tokens, BS)
    batch = KVEventBatch(1.0, [AllBlocksCleared(), BlockStored(h[:30], None, tokens[:120]),
                               BlockStored(h[30:], h[29], tokens[120:], medium="host"), BlockRemoved(h[:3])],
                         epoch=7, seq=5, snapshot=True)
    parts = pb(batch, limit=40)  # 40 hashes and tokens a message: 8 blocks with their tokens
    assert len(parts) > 5 and [p.more for p in parts] == [True] * (len(parts) - 1) + [False]
    assert {(p.epoch, p.seq, p.snapshot) for p in parts} == {(7, 5, True)}
    stored = [e.block_stored for p in parts for e in p.events if e.WhichOneof("event") == "block_stored"]
    assert [x for s in stored for x in s.block_hashes] == h and [t for s in stored for t in s.token_ids] == tokens
    assert all(s.parent_block_hash == (h[h.index(s.block_hashes[0]) - 1] if s.block_hashes[0] != h[0] else 0)
               for s in stored)
    whole, split = KVIndex(), KVIndex()
    KVFeed(whole, "r").apply(pb(batch)[0])
    feed = KVFeed(split, "r")
    for p in parts:
        assert feed.synced is False and feed.apply(p) is None
    assert feed.synced and split.blocks == whole.blocks and len(whole.blocks["r"]) == 47
    assert whole.tiers("r")["host"] == h[30:]


# -- the router's feed: gaps, epochs, degraded -----------------------------------------------------------

def test_the_feed_asks_for_a_resync_on_a_gap_or_a_new_epoch_without_its_snapshot():
    h = prefix_hashes(list(range(40)), BS)
    index = KVIndex()
    feed = KVFeed(index, "r")
    stored = [KVEventBatch(0, [BlockStored([x], None)], epoch=9, seq=s) for s, x in ((4, h[2]), (5, h[3]))]
    assert feed.apply(pb(stored[0])[0]) == "gap"  # a stream that does not begin with a snapshot
    feed = KVFeed(index, "r")
    assert feed.apply(pb(KVEventBatch(0, [AllBlocksCleared(), BlockStored(h[:2], None)], 9, 3, True))[0]) is None
    assert feed.synced and index.positions["r"] == (9, 3)
    assert feed.apply(pb(stored[0])[0]) is None and index.num_blocks("r") == 3
    assert feed.apply(pb(KVEventBatch(0, [BlockStored([h[5]], None)], 9, 7))[0]) == "gap"  # (6 is missing)
    assert h[5] not in index.blocks["r"]  # nothing of a batch past a gap is believed
    feed = KVFeed(index, "r")
    feed.apply(pb(KVEventBatch(0, [AllBlocksCleared(), BlockStored(h[:2], None)], 9, 3, True))[0])
    assert feed.apply(pb(KVEventBatch(0, [BlockRemoved([h[0]])], 10, 1))[0]) == "epoch"
    # a new epoch that begins with its snapshot is fine (the cache started over)
    assert feed.apply(pb(KVEventBatch(0, [AllBlocksCleared(), BlockStored(h[7:9], None)], 10, 1, True))[0]) is None
    assert set(index.blocks["r"]) == set(h[7:9])
    from stagemesh.v1 import scheduler_pb2

    bad = scheduler_pb2.KVEventBatch(epoch=10, seq=2)  # more tokens than its blocks hold: not a scheduler's
    bad.events.add().block_stored.CopyFrom(scheduler_pb2.BlockStored(block_hashes=[h[9]], block_size=BS,
                                                                     token_ids=list(range(2 * BS))))
    assert feed.apply(bad) == "malformed"


def test_a_degraded_replica_counts_no_hit_and_routing_falls_back_to_load():
    index = KVIndex()
    policy = KVAware(index)
    a, b = FakeReplica("a", load=0), FakeReplica("b", load=3)
    prompt = list(range(100, 120))
    index.stored("b", prefix_hashes(prompt, BS), BS)
    assert policy.pick([a, b], prompt) is b and policy.last_matched_tokens == 20
    assert index.mark_degraded("b", "gap") is None and index.mark_degraded("b", "gap") == "gap"
    assert policy.pick([a, b], prompt) is a and policy.last_matched_tokens == 0  # its belief may be stale
    assert index.mark_synced("b") and not index.mark_synced("b")
    assert policy.pick([a, b], prompt) is b


# -- tiers --------------------------------------------------------------------------------------------

def test_a_hit_is_weighed_by_its_tier_and_a_prefix_goes_on_across_tiers():
    index = KVIndex()
    policy = KVAware(index)
    dev, host, disk = FakeReplica("dev"), FakeReplica("host"), FakeReplica("disk")
    prompt = list(range(100, 140))  # 10 blocks
    h = prefix_hashes(prompt, BS)
    index.stored("disk", h, BS, "disk")
    assert policy.pick([dev, host, disk], prompt) is disk and policy.last_matched_tokens == 40
    index.stored("host", h, BS, "host")
    assert policy.pick([disk, dev, host], prompt) is host
    index.stored("dev", h, BS, "device")
    assert policy.pick([disk, host, dev], prompt) is dev and policy.last_matched_tokens == 40
    # a prefix goes on across tiers: 5 blocks on the device and 5 in host beat 6 on the device alone
    index.clear("dev")
    index.stored("dev", h[:6], BS)
    index.clear("host")
    index.stored("host", h[:5], BS)
    index.stored("host", h[5:], BS, "host")
    index.clear("disk")
    assert policy.pick([dev, host, disk], prompt) is host and policy.last_matched_tokens == 40
    # BlockRemoved(host) leaves a block that is also on the device; removing it from its last tier ends the run
    index.stored("host", h[5:7], BS, "device")
    index.removed("host", h[5:], "host")
    assert index.match("host", prompt, {})[0] == 28
    index.removed("host", [h[2]], "device")
    assert index.match("host", prompt, {}) == (8, 8.0)
    index.removed("host", [12345, 67890], "disk")  # unknown blocks: nothing happens
    assert index.num_blocks("host") == 6


def test_load_still_beats_a_better_tier_when_the_gap_is_large():
    index = KVIndex()
    policy = KVAware(index, balance_abs=32, balance_rel=1.5)
    idle, busy = FakeReplica("idle", load=0), FakeReplica("busy", load=40)
    prompt = list(range(100, 140))
    h = prefix_hashes(prompt, BS)
    index.stored("busy", h, BS)
    index.stored("idle", h[:3], BS, "disk")
    assert policy.pick([idle, busy], prompt) is idle and policy.last_matched_tokens == 12
    busy.load = 20  # within the balance: the device hit wins
    assert policy.pick([idle, busy], prompt) is busy


def test_the_tiers_events_through_the_wire_give_the_router_the_replicas_view_of_every_tier():
    """The scheduler's tiers (scheduler/tiers.py: write-through to host and disk, LRU) emit their events into
    the block manager's; through the hub and the wire, the router's index holds what each tier holds."""
    from scheduler.config import SchedulerConfig
    from scheduler.scheduler import Scheduler
    from stagemesh.core.sampling_params import SamplingParams
    from stagemesh.core.step import SampledToken

    s = Scheduler(SchedulerConfig(num_kv_blocks=8, max_model_len=64, block_size=BS, eos_token_ids=(2,),
                                  num_host_kv_blocks=6, num_disk_kv_blocks=10), ())

    def finish(request_id: str, prompt: list[int]) -> None:
        s.add_request(EngineRequest(request_id, prompt, SamplingParams(max_tokens=1, ignore_eos=True)))
        while s.has_unfinished():
            out = s.schedule()
            s.update_from_output(out, [SampledToken(c.seq_id, 9) for c in out.step_batch.chunks if c.sample])
            job = s.kv.tiers.take_store()
            if job is not None:
                s.kv.tiers.stored(job, True)

    async def go():
        hub = KVEventHub(lambda: s.kv, tick_s=0.01)
        queue = hub.subscribe()
        index = KVIndex()
        feed = KVFeed(index, "r")
        prompts = [list(range(10 + 13 * i, 23 + 13 * i)) for i in range(6)]  # 3 full blocks each
        for i, prompt in enumerate(prompts):
            finish(f"r{i}", prompt)
            await asyncio.sleep(0.03)
            while not queue.empty():
                for message in pb(queue.get_nowait()):
                    assert feed.apply(message) is None
        assert feed.synced
        want = {medium: set(hashes) for medium, hashes in s.kv.snapshot_hashes() if hashes}
        assert {medium: set(hashes) for medium, hashes in index.tiers("r").items()} == want
        assert set(want) == {"device", "host", "disk"} and len(want["disk"]) == 10  # (LRU: the disk tier is full)
        # a prompt's hit, block by block from the replica's own view: the best tier holding it, until a miss
        for prompt in prompts:
            n, score = 0, 0.0
            for h in prefix_hashes(prompt, BS):
                weights = [w for medium, w in (("device", 1.0), ("host", 0.8), ("disk", 0.5)) if h in want[medium]]
                if not weights:
                    break
                n, score = n + 1, score + max(weights)
            assert index.match("r", prompt + [1], {}) == (n * BS, score * BS)
        hits = {index.match("r", p + [1], {}) for p in prompts}
        assert {(0, 0.0), (12, 6.0), (12, 12.0)} <= hits  # gone, on disk alone, on the device
        hub.unsubscribe(queue)

    asyncio.run(go())


# -- bounds --------------------------------------------------------------------------------------------

def test_a_flood_of_stored_events_cannot_grow_the_index_past_its_cap():
    index = KVIndex(hard_cap=10_000)
    feed = KVFeed(index, "r")
    assert feed.apply(pb(KVEventBatch(0, [AllBlocksCleared()], 3, 1, True))[0]) is None
    reason, seq, sizes = None, 1, []
    for seq in range(2, 40):  # 1,000 new hashes a batch: far past the cap
        reason = feed.apply(pb(KVEventBatch(0, [BlockStored(list(range(seq * 1000, seq * 1000 + 1000)), None)],
                                            3, seq))[0])
        sizes.append(index.num_blocks("r"))
        if reason:
            break
    assert reason == "overflow" and max(sizes) <= 10_000 and index.num_blocks("r") == 0  # cleared: not trusted
    index.set_capacity("r", 100)  # the replica reports what it holds: the cap follows it
    assert index.cap("r") == 200 + CAP_SLACK
    assert not index.stored("r", range(10**6), BS) and index.num_blocks("r") == index.cap("r")
    index.clear("r")
    index.removed("r", range(10**5))  # removing unknown blocks costs no memory
    assert index.num_blocks("r") == 0


def test_a_snapshot_past_grpcs_4_mib_limit_is_received_whole():
    """GetKVSnapshot over a real gRPC server in this process (default message limits on both ends): a replica
    whose host tier holds 700,000 blocks (some 7 MB of hashes) streams its snapshot in parts, and the caller
    joins them into the replica's whole view, in order."""
    import grpc
    from types import SimpleNamespace

    from scheduler.service import SchedulerServicer
    from stagemesh.core.hash_parts import joined_tiers
    from stagemesh.v1 import scheduler_pb2, scheduler_pb2_grpc

    kv = TieredBlockManager(8, BS)
    h = fill(kv, "a", list(range(8)))
    kv.host = [(2**64 - 1 - i) for i in range(700_000)]  # (varints of 10 bytes: the largest a hash takes)
    hub = KVEventHub(lambda: kv)
    # the servicer's driver: what GetKVSnapshot reads (its KV event hub), nothing more
    driver = SimpleNamespace(kv_events=hub, status=lambda: SimpleNamespace(block_size=BS), pipeline=None,
                             cfg=SimpleNamespace(scheduler=SimpleNamespace(lora=None)))

    async def go():
        server = grpc.aio.server()
        scheduler_pb2_grpc.add_SchedulerServicer_to_server(SchedulerServicer(driver, "m", "/m", 16), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                call = scheduler_pb2_grpc.SchedulerStub(channel).GetKVSnapshot(scheduler_pb2.GetKVSnapshotRequest(),
                                                                               timeout=30)
                return [part async for part in call]
        finally:
            await server.stop(None)

    parts = asyncio.run(go())
    assert sum(p.ByteSize() for p in parts) > 4 * 2**20 and len(parts) == 4
    assert all(p.ByteSize() < 4 * 2**20 for p in parts) and [p.more for p in parts] == [True, True, True, False]
    assert {(p.epoch, p.seq, p.block_size) for p in parts} == {(*hub.snapshot()[:2], BS)}
    _, tiers = joined_tiers(iter(parts))
    assert tiers == {"device": h, "host": kv.host}


# -- real processes ------------------------------------------------------------------------------------

def metric(router, name: str, **labels: str) -> float:
    """The value of one series of the router's /metrics (-1: absent)."""
    import requests

    text = requests.get(f"{router.base_url}/metrics", timeout=10).text
    for found, body, value in re.findall(r"^([^{\s]+)\{([^}]*)\} (\S+)$", text, re.M):
        if found == name and dict(re.findall(r'(\w+)="([^"]*)"', body)) == labels:
            return float(value)
    return -1.0


def replica_view(mesh) -> dict[str, set[int]]:
    from stagemesh.core.hash_parts import joined_tiers
    from stagemesh.v1 import scheduler_pb2

    _, tiers = joined_tiers(mesh.stub.GetKVSnapshot(scheduler_pb2.GetKVSnapshotRequest(), timeout=5))
    return {medium: set(hashes) for medium, hashes in tiers.items() if hashes}


def router_view(control, address: str) -> tuple[bool, dict[str, set[int]]]:
    from stagemesh.core.hash_parts import joined_tiers
    from stagemesh.v1 import router_pb2

    parts, tiers = joined_tiers(control.GetKVIndex(router_pb2.GetKVIndexRequest(replica=address), timeout=5))
    return parts[0].degraded, {medium: set(hashes) for medium, hashes in tiers.items() if hashes}


def wait_until(what: str, ok, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not ok():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def in_sync(control, mesh) -> bool:
    degraded, view = router_view(control, mesh.address)
    return not degraded and view == replica_view(mesh)


@pytest.mark.slow
def test_a_dropped_batch_and_a_router_restart_end_with_the_index_equal_to_the_replicas_view(tiny_model_dir,
                                                                                             tmp_path):
    from mesh import Mesh, Router, free_port, internal_channel
    from stagemesh.core.sampling_params import SamplingParams
    from stagemesh.v1 import router_pb2_grpc
    from tiny_models import with_word_tokenizer

    model_dir = with_word_tokenizer(tiny_model_dir("llama"), tmp_path / "model")
    greedy = SamplingParams(max_tokens=1, ignore_eos=True)
    mesh = Mesh(model_dir, [4], log_dir=tmp_path)
    mesh.env[DROP_SEQ_ENV] = "4"  # the replica's hub loses its 4th batch of every epoch
    port = free_port()
    args = ("--policy", "kv-aware", "--control-port", str(port))
    with mesh, internal_channel(f"127.0.0.1:{port}") as channel:
        control = router_pb2_grpc.RouterControlStub(channel)
        replica = mesh.address
        with Router(model_dir, [mesh.address], args, log_dir=tmp_path) as router:
            wait_until("the router's first snapshot", lambda: in_sync(control, mesh))
            for i in range(5):  # a batch each (at least): the 4th is lost, the router sees the gap at the 5th
                mesh.generate([list(range(100 + 50 * i, 140 + 50 * i))], greedy)
                time.sleep(0.15)
            wait_until("a resync after the gap",
                       lambda: metric(router, "stagemesh:router_kv_index_resyncs_total", replica=replica,
                                      reason="gap") >= 1)
            wait_until("the router's index equals the replica's view", lambda: in_sync(control, mesh))
            assert len(replica_view(mesh)["device"]) >= 10  # (2 blocks of 16 a prompt)
            assert metric(router, "stagemesh:router_kv_index_degraded", replica=replica) == 0
        log = next(tmp_path.glob("router-*.log")).read_text()
        assert re.search(r"KV index of replica \S+ is DEGRADED \(gap\)", log) and "is in sync" in log
        # a router restart: the new one learns what the replica holds (cached while no router ran, too) from
        # its first snapshot, and a stream that breaks makes it degraded at once, its blocks forgotten
        mesh.generate([list(range(20, 68))], greedy)
        with Router(model_dir, [mesh.address], args, log_dir=tmp_path) as router:
            wait_until("the new router's index equals the replica's view", lambda: in_sync(control, mesh))
            assert len(router_view(control, mesh.address)[1]["device"]) >= 13
            mesh.kill_scheduler()
            wait_until("degraded once the stream is lost",
                       lambda: metric(router, "stagemesh:router_kv_index_degraded", replica=replica) == 1)
            assert metric(router, "stagemesh:router_kv_index_blocks", replica=replica) == 0
            assert metric(router, "stagemesh:router_kv_index_resyncs_total", replica=replica,
                          reason="stream_lost") == 1
            mesh.start_scheduler()  # back (its stage joins it again): a new epoch, its snapshot, in sync
            wait_until("in sync with the restarted scheduler", lambda: in_sync(control, mesh), timeout=60)
            assert metric(router, "stagemesh:router_kv_index_degraded", replica=replica) == 0


@pytest.mark.slow
def test_a_routers_index_of_a_tiered_replica_holds_each_tier_as_the_replica_does(tiny_model_dir, tmp_path):
    """Real KV tiers (docs/kv-tiers.md: a small pool, host and disk below it): the router's index of the replica,
    per tier, is the replica's own view, and the prompt evicted from the pool is still a hit there."""
    from mesh import Mesh, Router, free_port, internal_channel
    from stagemesh.core.sampling_params import SamplingParams
    from stagemesh.v1 import router_pb2_grpc
    from tiny_models import with_word_tokenizer

    model_dir = with_word_tokenizer(tiny_model_dir("llama"), tmp_path / "model")
    greedy = SamplingParams(max_tokens=1, ignore_eos=True)
    mesh = Mesh(model_dir, [4], log_dir=tmp_path,
                scheduler_args=("--kv-offloading-size", "0.001", "--kv-offloading-disk-size", "0.01"),
                stage_args=("--kv-cache-memory", "180224", "--kv-offloading-disk-path", str(tmp_path / "disk")))
    port = free_port()
    with mesh, internal_channel(f"127.0.0.1:{port}") as channel, \
            Router(model_dir, [mesh.address], ("--policy", "kv-aware", "--control-port", str(port)),
                   log_dir=tmp_path):
        control = router_pb2_grpc.RouterControlStub(channel)
        prompt = list(range(10, 80))  # 4 full blocks of 16
        mesh.generate([prompt], greedy)
        for i in range(3):  # the pool's 11 blocks go to other prompts
            mesh.generate([list(range(100 + i * 90, 190 + i * 90))], greedy)
        first = prefix_hashes(prompt, 16)[:4]
        view = replica_view(mesh)
        assert {"host", "disk"} <= set(view) and set(first) <= view["host"] and not set(first) & view["device"]
        wait_until("the router's index equals the replica's view, tier by tier", lambda: in_sync(control, mesh))
