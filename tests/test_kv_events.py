"""KV events and the router's global index (issue 33): block hashes equal in every process, the block
manager's events as blocks enter and leave the prefix cache, the hub's snapshots, the index and the
kv-aware policy; then real processes: a router sends a prompt to the replica whose events say it holds
its prefix, forgets a prefix evicted there, and forgets a replica whose scheduler died."""
from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import time
from dataclasses import dataclass

import pytest
import requests

from router.kv_index import KVAware, KVIndex
from scheduler.block_manager import BlockManager
from scheduler.kv_events import AllBlocksCleared, BlockStored, KVEventHub
from stagemesh.core.block_hash import chain_hash, prefix_hashes

BS = 4


def test_block_hashes_are_the_same_in_every_process():
    code = "from stagemesh.core.block_hash import prefix_hashes; print(prefix_hashes(list(range(100, 140)), 16))"
    there = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    here = prefix_hashes(list(range(100, 140)), 16)
    assert there.stdout.strip() == str(here) and len(here) == 2
    assert here[1] == chain_hash(here[0], list(range(116, 132)))
    assert chain_hash(None, [1, 2]) != chain_hash(None, [2, 1]) != chain_hash(here[0], [1, 2])


def test_the_block_manager_reports_blocks_stored_and_evicted():
    kv = BlockManager(num_blocks=6, block_size=BS)
    kv.allocate("a", 10)  # 3 blocks, 2 of them full
    kv.cache_full_blocks("a", list(range(10)), 10)
    assert kv.drain_events() == []  # nobody listens: nothing recorded
    kv.start_events()
    kv.allocate("b", 9)  # 3 blocks
    tokens = list(range(50, 59))
    kv.cache_full_blocks("b", tokens, 4)
    kv.cache_full_blocks("b", tokens, 9)
    h = prefix_hashes(tokens, BS)
    assert kv.drain_events() == [BlockStored([h[0]], None, tokens[:4]), BlockStored([h[1]], h[0], tokens[4:8])]
    kv.free_request("b")
    kv.free_request("a")
    kv.allocate("c", 24)  # every block: the freed ones are handed out again, the cached ones among them
    removed = [x for e in kv.drain_events() for x in e.block_hashes]
    assert sorted(removed) == sorted([*prefix_hashes(list(range(10)), BS), *h])
    assert kv.cached_hashes() == []


def test_the_hub_snapshots_then_streams_and_starts_over_with_the_cache():
    async def go():
        first = BlockManager(8, BS)
        first.allocate("a", 8)
        first.cache_full_blocks("a", list(range(8)), 8)
        current = {"kv": first}
        hub = KVEventHub(lambda: current["kv"], tick_s=0.01)
        queue = hub.subscribe()
        snap = await queue.get()
        assert snap.events == [AllBlocksCleared(), BlockStored(prefix_hashes(list(range(8)), BS), None)]
        first.allocate("b", 4)
        first.cache_full_blocks("b", [9, 9, 9, 9], 4)
        batch = await asyncio.wait_for(queue.get(), 1)
        assert batch.events == [BlockStored([chain_hash(None, [9, 9, 9, 9])], None, [9, 9, 9, 9])]
        current["kv"] = BlockManager(8, BS)  # a new epoch: an empty cache
        batch = await asyncio.wait_for(queue.get(), 1)
        assert batch.events == [AllBlocksCleared()]
        current["kv"] = None  # the pipeline is gone
        assert (await asyncio.wait_for(queue.get(), 1)).events == [AllBlocksCleared()]
        hub.unsubscribe(queue)
        await asyncio.sleep(0.05)
        assert hub._task is None  # no subscriber: the hub stops following

    asyncio.run(go())


@dataclass
class FakeReplica:
    address: str
    load: int = 0


def test_kv_aware_routes_by_cached_prefix_unless_that_replica_is_much_busier():
    index, policy = KVIndex(), None
    policy = KVAware(index)
    a, b, c = FakeReplica("a"), FakeReplica("b"), FakeReplica("c")
    prompt = list(range(100, 120))  # 5 blocks of 4
    hashes = prefix_hashes(prompt, BS)
    assert policy.pick([a, b, c], prompt) is a  # nothing cached anywhere: the least loaded (first)
    index.stored("b", hashes[:2], BS)
    index.stored("c", hashes[:4], BS)
    index.stored("c", [chain_hash(None, [1, 2, 3, 4])], BS)
    assert policy.pick([a, b, c], prompt) is c and policy.last_matched_tokens == 16
    index.removed("c", [hashes[0]])  # the first block evicted: nothing after it counts either
    assert policy.pick([a, b, c], prompt) is b and policy.last_matched_tokens == 8
    b.load = 100  # a hit does not pay for a long queue
    assert policy.pick([a, b, c], prompt) is a
    index.clear("b")
    b.load = 0
    assert policy.pick([a, b, c], prompt) is a and index.num_blocks("b") == 0


# -- real processes ------------------------------------------------------------------------------------

def scrape(url: str) -> str:
    return requests.get(url, timeout=10).text


def index_blocks(router, address: str) -> int:
    match = re.search(r'stagemesh:router_kv_index_blocks\{replica="' + re.escape(address) + r'"\} (\S+)',
                      scrape(f"{router.base_url}/metrics"))
    return int(float(match.group(1))) if match else 0


def routed(router, address: str) -> int:
    """Requests the router finished on that replica."""
    text = scrape(f"{router.base_url}/metrics")
    return sum(int(float(n)) for n in re.findall(r'stagemesh:router_requests_total\{[^}]*replica="' +
                                                  re.escape(address) + r'"[^}]*\} (\S+)', text))


def wait_until(what: str, ok, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not ok():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def hits(mesh) -> int:
    from stagemesh.v1 import scheduler_pb2

    return mesh.stub.GetStats(scheduler_pb2.GetStatsRequest(), timeout=5).prefix_cache_hits


class EventWatcher:
    """The test's own subscription to a scheduler's KV events: the hashes it has seen removed."""

    def __init__(self, mesh):
        import threading

        from stagemesh.v1 import scheduler_pb2

        self.removed: set[int] = set()
        self.call = mesh.stub.WatchKVEvents(scheduler_pb2.WatchKVEventsRequest(), timeout=120)
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        import grpc

        try:
            for batch in self.call:
                for event in batch.events:
                    if event.WhichOneof("event") == "block_removed":
                        self.removed.update(event.block_removed.block_hashes)
        except grpc.RpcError:
            pass

    def close(self) -> None:
        self.call.cancel()
        self.thread.join(timeout=10)


@pytest.mark.slow
def test_a_router_follows_the_replicas_kv_events(tiny_model_dir, tmp_path):
    from mesh import Mesh, Router, completion_ids
    from stagemesh.core.sampling_params import SamplingParams
    from tiny_models import with_word_tokenizer

    model_dir = with_word_tokenizer(tiny_model_dir("llama"), tmp_path / "model")
    greedy = SamplingParams(max_tokens=2, ignore_eos=True)
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    # b's cache: 12 blocks of 16 tokens (4 layers x K and V x 2 KV heads x 16 dims x 16 tokens x 4 bytes each)
    small = ("--kv-cache-memory", str(12 * 4 * 2 * 2 * 16 * 16 * 4))
    with Mesh(model_dir, [4], log_dir=tmp_path / "a") as a, \
            Mesh(model_dir, [4], log_dir=tmp_path / "b", stage_args=small) as b:
        with Router(model_dir, [a.address, b.address], ("--served-model-name", "m", "--policy", "kv-aware"),
                    log_dir=tmp_path) as router:
            prefix = list(range(10, 74))  # four full blocks
            b.generate([prefix + [5]], greedy)  # computed on b behind the router's back: only b's events tell
            wait_until("the router's index holds b's blocks", lambda: index_blocks(router, b.address) >= 4)
            assert index_blocks(router, a.address) == 0
            before = hits(a), hits(b), routed(router, b.address)
            completion_ids(router.base_url, "m", prefix + [6, 7], 2)  # least load alone would pick a (the first)
            assert (hits(a) - before[0], hits(b) - before[1], routed(router, b.address) - before[2]) == (0, 64, 1)
            # other prompts on b evict the prefix: the router forgets it there (with a stale index it would
            # send the prefix to b again; with none, least load sends it to a)
            watcher = EventWatcher(b)
            try:
                first_block = prefix_hashes(prefix, 16)[0]
                for i in range(8):
                    b.generate([list(range(200 + 20 * i, 240 + 20 * i)) + [3]], greedy)
                wait_until("b evicted the prefix's first block", lambda: first_block in watcher.removed)
            finally:
                watcher.close()
            time.sleep(0.5)  # the router got the same batch: let it apply it
            before = routed(router, a.address), routed(router, b.address)
            completion_ids(router.base_url, "m", prefix + [8], 2)
            assert (routed(router, a.address) - before[0], routed(router, b.address) - before[1]) == (1, 0)
            b.kill_scheduler()  # a replica whose stream is gone is forgotten at once
            wait_until("b's blocks dropped", lambda: index_blocks(router, b.address) == 0)
