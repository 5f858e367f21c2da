"""Rebalancing (router.rebalance, Scheduler.Migrate): in the scheduler core, up to N running requests between two
decode steps end "migrated" with their KV held, the most tokens left first, and the rest run on; the router's plan
moves half the gap between the busiest and the least loaded ready replica, and nothing within --rebalance-min-gap;
a crafted Migrate is refused. Then real processes: a router with one replica under 4 long streams is given a
second (SetReplicas, as `stagemesh scale` does); it moves 2 of them there, which read their KV from the first
and finish token-exact, counted how="kv"."""
from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import requests

from router.rebalance import plan
from router.replicas import Replica
from scheduler import handover
from test_migration import long_streams, make, step
from stagemesh.core.engine_request import EngineRequest
from stagemesh.core.sampling_params import SamplingParams


def test_some_running_requests_move_with_their_kv_the_most_tokens_left_first():
    s = make()
    for i, max_tokens in enumerate((40, 80)):
        s.add_request(EngineRequest(f"r{i}", list(range(3, 13)), SamplingParams(max_tokens=max_tokens)))
    for _ in range(3):
        step(s)
    [out] = handover.migrate_some(s, 1, with_kv=True)
    assert out.request_id == "r1" and out.finish_reason == "migrated"  # (77 tokens left against r0's 37)
    assert out.held_kv is not None and out.held_kv.num_tokens == 10 + 3 - 1
    assert [r.request_id for r in s.running] == ["r0"]  # the other goes on here
    for _ in range(10):  # r0: 26 tokens left, fewer than a move pays for
        step(s)
    assert handover.migrate_some(s, 5, with_kv=False) == [] and s.has_unfinished()
    [out] = handover.migrate_some(s, 5, with_kv=False, min_tokens_left=1)
    assert out.held_kv is None and not s.has_unfinished()
    s.add_request(EngineRequest("r2", list(range(3, 13)), SamplingParams(max_tokens=20)))
    s.schedule()  # in flight, and its prompt not computed yet: it stays
    assert handover.migrate_some(s, 5, with_kv=True) == [] and s.has_unfinished()


def replica(address: str, running: int, waiting: int = 0, **kw) -> Replica:
    r = Replica(address, healthy=True, num_running=running, num_waiting=waiting)
    for k, v in kw.items():
        setattr(r, k, v)
    return r


def test_the_plan_moves_half_the_gap_from_the_busiest_ready_replica():
    async def check() -> None:
        a, b, c = replica("a:1", 8), replica("b:1", 0), replica("c:1", 3, waiting=2)
        assert plan([a, b, c], 4) == (a, 4)
        assert plan([a, replica("b:1", 5)], 4) is None  # within the gap
        assert plan([a, replica("b:1", 0, cordoned=True)], 4) is None  # (about to drain: no new work)
        assert plan([a, replica("b:1", 0, kv_role="prefill")], 4) is None  # (disaggregated roles: not balanced)
        assert plan([a, replica("b:1", 0, healthy=False)], 4) is None
        for r in (a, b, c):
            await r.close()

    import asyncio
    asyncio.run(check())


@pytest.mark.slow
def test_a_replica_given_to_the_router_takes_half_the_running_streams_with_their_kv(wide_model_dir, tmp_path):
    from mesh import Mesh, Router, free_port, internal_channel
    from parity import prompts
    from stagemesh.v1 import router_pb2, router_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
    from tiny_models import greedy_tokens

    batch = prompts(384, (5, 3, 9, 17))
    long = 400
    want = greedy_tokens(wide_model_dir, batch, long)
    args = ("--served-model-name", "m")
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    control = free_port()
    # each a --kv-peer of the other: a request the rebalancer moves back (B to A, once A's own have ended) goes
    # with its KV too
    a = Mesh(wide_model_dir, [4], log_dir=tmp_path / "a", scheduler_args=args)
    b = Mesh(wide_model_dir, [4], log_dir=tmp_path / "b", scheduler_args=(*args, "--kv-peer", a.address))
    a.scheduler_args += ["--kv-peer", b.address]
    with a, b, \
            Router(wide_model_dir, [a.address], ("--control-port", str(control), "--rebalance-interval", "0.3",
                                                 "--rebalance-min-gap", "2"), log_dir=tmp_path) as router:
        stub = scheduler_pb2_grpc.SchedulerStub(internal_channel(a.address))
        with pytest.raises(grpc.RpcError) as refused:  # a crafted call: refused, and the replica serves on
            stub.Migrate(scheduler_pb2.MigrateRequest(max_requests=0), timeout=10)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with ThreadPoolExecutor(4) as pool:
            streams = long_streams(pool, router.base_url, batch, long)  # all four on A, the router's one replica
            entries = [router_pb2.ReplicaEntry(address=x.address) for x in (a, b)]
            router_pb2_grpc.RouterControlStub(internal_channel(f"127.0.0.1:{control}")).SetReplicas(
                router_pb2.SetReplicasRequest(replicas=entries), timeout=10)
            results = [s.result(timeout=300) for s in streams]
        metrics = requests.get(f"{router.base_url}/metrics", timeout=10).text
    for i, got in enumerate(results):
        assert got.done and got.resumes == 0 and got.token_ids == want[i], f"stream {i}"
    logs = {name: (tmp_path / name / "scheduler.log").read_text() for name in ("a", "b")}
    moves = {name: [(int(n), int(kv)) for n, kv in re.findall(
        r"rebalance: (\d+) running request\(s\) handed on \((\d+) with their KV\)", text)]
        for name, text in logs.items()}
    assert moves["a"] and moves["a"][0] == (2, 2), logs["a"][-2000:]  # half of A's 4, each with its KV
    kv = re.search(r'stagemesh:migrated_requests_total\{how="kv"\} (\S+)', metrics)
    assert kv and float(kv.group(1)) == sum(k for m in moves.values() for _, k in m), metrics[-3000:]
    assert "fetched from" in logs["b"]
