"""How fast a restarted router's KV index (--policy kv-aware) is whole again (issue 44): two replicas (a tiny
llama each, one stage, real processes) whose prefix caches get --prompts distinct prompts of --prompt-len
tokens each, then a router started against them, --restarts times: from its process start to its /ready, and to
its index (RouterControl.GetKVIndex) equal to every replica's own view (Scheduler.GetKVSnapshot). Then, without
processes, what applying one snapshot costs the router (KVFeed over the wire messages of --synthetic-blocks
hashes, parts included): the part of the recovery that grows with the cache.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_kv_index_recovery.py [--prompts 256 --prompt-len 256
        --restarts 3 --synthetic-blocks 1000000]
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from mesh import Mesh, Router, free_port, internal_channel  # noqa: E402
from tiny_models import make_tiny_model, with_word_tokenizer  # noqa: E402

from router.kv_index import KVFeed, KVIndex  # noqa: E402
from scheduler.kv_events import AllBlocksCleared, BlockStored, KVEventBatch  # noqa: E402
from scheduler.replies import kv_batch_to_pbs  # noqa: E402
from stagemesh.core.hash_parts import joined_tiers  # noqa: E402
from stagemesh.core.sampling_params import SamplingParams  # noqa: E402
from stagemesh.v1 import router_pb2, router_pb2_grpc, scheduler_pb2  # noqa: E402


def replica_view(mesh) -> dict[str, set[int]]:
    _, tiers = joined_tiers(mesh.stub.GetKVSnapshot(scheduler_pb2.GetKVSnapshotRequest(), timeout=30))
    return {medium: set(hashes) for medium, hashes in tiers.items() if hashes}


def in_sync(control, mesh) -> bool:
    try:
        parts, tiers = joined_tiers(control.GetKVIndex(router_pb2.GetKVIndexRequest(replica=mesh.address), timeout=5))
    except Exception:  # noqa: BLE001  (the control port is not up yet)
        return False
    view = {medium: set(hashes) for medium, hashes in tiers.items() if hashes}
    return not parts[0].degraded and view == replica_view(mesh)


def restart_once(model_dir: Path, meshes: list[Mesh], log_dir: Path) -> tuple[float, float]:
    """(seconds to /ready, seconds to every replica's index in sync), from the router's process start."""
    import requests

    port = free_port()
    start = time.monotonic()
    router = Router(model_dir, [m.address for m in meshes], ("--policy", "kv-aware", "--control-port", str(port)),
                    log_dir=log_dir)
    try:
        ready = None
        while ready is None:  # (the control port is up before /ready: a channel opened then needs no retry)
            assert time.monotonic() - start < 120, "the router never got ready"
            try:
                if requests.get(f"{router.base_url}/ready", timeout=2).status_code == 200:
                    ready = time.monotonic() - start
            except requests.RequestException:
                time.sleep(0.02)
        with internal_channel(f"127.0.0.1:{port}") as channel:
            control = router_pb2_grpc.RouterControlStub(channel)
            while not all(in_sync(control, m) for m in meshes):
                assert time.monotonic() - start < 120, "the router's index never caught up"
                time.sleep(0.02)
        return ready, time.monotonic() - start
    finally:
        router.__exit__()


def synthetic(num_blocks: int, rounds: int = 3) -> tuple[float, int]:
    """(median seconds to apply a snapshot of num_blocks hashes, its wire messages)."""
    hashes = random.Random(0).sample(range(1, 2**63), num_blocks)
    batch = KVEventBatch(time.time(), [AllBlocksCleared(), BlockStored(hashes, None)], 1, 1, True)
    messages = kv_batch_to_pbs(batch, 16)
    wire = [m.SerializeToString() for m in messages]
    times = []
    for _ in range(rounds):
        index = KVIndex()
        t = time.perf_counter()  # (from the bytes a router receives: their parsing included)
        feed = KVFeed(index, "r")
        for data in wire:
            assert feed.apply(scheduler_pb2.KVEventBatch.FromString(data)) is None
        times.append(time.perf_counter() - t)
        assert feed.synced and index.num_blocks("r") == num_blocks
    return statistics.median(times), len(messages)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=256, help="distinct prompts cached on each replica")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--restarts", type=int, default=3)
    p.add_argument("--synthetic-blocks", type=int, default=1_000_000)
    args = p.parse_args()
    log_dir = Path(tempfile.mkdtemp(prefix="stagemesh-kv-index-"))
    model_dir = with_word_tokenizer(make_tiny_model(log_dir / "tiny"), log_dir / "model")
    print(f"{os.cpu_count()} cores; 2 replicas (tiny llama, 1 stage each), {args.prompts} prompts of "
          f"{args.prompt_len} tokens cached on each; logs in {log_dir}", flush=True)
    greedy = SamplingParams(max_tokens=1, ignore_eos=True)
    rng = random.Random(1)
    for name in ("a", "b"):
        (log_dir / name).mkdir()
    with Mesh(model_dir, [4], log_dir=log_dir / "a") as a, Mesh(model_dir, [4], log_dir=log_dir / "b") as b:
        t = time.monotonic()
        for mesh in (a, b):
            prompts = [[rng.randrange(384) for _ in range(args.prompt_len)] for _ in range(args.prompts)]
            with ThreadPoolExecutor(8) as pool:
                list(pool.map(lambda i: mesh.submit(f"fill{i}", prompts[i], greedy), range(len(prompts))))
        blocks = [sum(len(v) for v in replica_view(m).values()) for m in (a, b)]
        print(f"filled in {time.monotonic() - t:.1f} s: {blocks[0]} and {blocks[1]} blocks cached", flush=True)
        results = []
        for r in range(args.restarts):
            ready, synced = restart_once(model_dir, [a, b], log_dir)
            results.append((ready, synced))
            print(f"restart {r + 1}: /ready after {ready:.2f} s, index equal to both replicas' views after "
                  f"{synced:.2f} s (+{synced - ready:.2f} s)", flush=True)
        print(f"median: ready {statistics.median(x[0] for x in results):.2f} s, in sync "
              f"{statistics.median(x[1] for x in results):.2f} s")
    seconds, parts = synthetic(args.synthetic_blocks)
    print(f"a snapshot of {args.synthetic_blocks:,} blocks ({parts} wire messages) applied by the router's KVFeed in "
          f"{seconds * 1000:.0f} ms ({args.synthetic_blocks / seconds / 1e6:.2f} M blocks/s)")


if __name__ == "__main__":
    main()
