"""A tenant's limits and saturation shedding at the router (router.limits, router.admission.shed), over fake
replicas: the 4th request of a tenant allowed 3 a minute is a 429 with Retry-After and OpenAI's x-ratelimit-*
headers, and so is one past its tokens_per_minute or its max_concurrency; two routers sharing a real
redis-server count one limit, per minute and in flight (a router that dies frees its places when their leases
lapse); a tenant whose requests have waited past --max-queue-wait gets a 503, the
lowest weights first, while another tenant still gets in. The per-tenant series count it all."""
from __future__ import annotations

import asyncio
import json
import threading

import pytest
import requests

from fake_replicas import FakeReplica, FakeRouter
from redis_server import INSTALLED, MISSING, RedisServer
from router.limits import WINDOW_S, MemoryWindows, TenantLimits, verdict
from router.tenants import Tenants
from tiny_models import with_word_tokenizer

M = "llama-tiny"
FILE = {"tenants": {
    "alpha": {"keys": ["ka"], "weight": 2},
    "beta": {"keys": ["kb"], "tokens_per_minute": 40, "max_concurrency": 1},
    "gamma": {"keys": ["kc"], "requests_per_minute": 3},
}}


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir, tmp_path_factory):
    return with_word_tokenizer(tiny_model_dir("llama"), tmp_path_factory.mktemp("limits") / "tok")


@pytest.fixture
def keys(tmp_path) -> str:
    path = tmp_path / "keys.json"
    path.write_text(json.dumps(FILE))
    return str(path)


def complete(router, key: str, max_tokens: int = 4) -> requests.Response:
    return requests.post(f"{router.base_url}/v1/completions", headers={"x-api-key": key}, timeout=30,
                         json={"model": M, "prompt": [5, 6, 7], "max_tokens": max_tokens})


def test_the_sliding_window_counts_the_last_minute_by_what_is_left_of_it():
    clock = [10 * WINDOW_S + 15]  # 15 s into a minute
    windows = MemoryWindows(lambda: clock[0])
    take = lambda n: asyncio.run(windows.take("t:requests", n, 10))  # noqa: E731
    assert [take(1).ok for _ in range(10)] == [True] * 10 and not take(1).ok
    clock[0] += 60  # 15 s into the next minute: the last minute's 10 weigh 7.5
    assert take(2).ok and not take(1).ok
    refused = verdict(previous=10, current=9, amount=1, limit=8, now=15.0)
    assert not refused.ok and refused.reset_s == 45.0  # this minute alone is past it: wait for the next


def test_a_tenants_4th_request_in_a_minute_is_a_429_with_retry_after_and_ratelimit_headers(model_dir, keys):
    with FakeRouter(model_dir, M, tenants=Tenants.from_file(keys), limits=TenantLimits(MemoryWindows())) as router:
        before = _metrics(router)  # (the counters are this process's: other tests' tenants may share names)
        answers = [complete(router, "kc") for _ in range(4)]
        assert [a.status_code for a in answers] == [200, 200, 200, 429]
        ok, refused = answers[2], answers[3]
        assert ok.headers["x-ratelimit-limit-requests"] == "3" and ok.headers["x-ratelimit-remaining-requests"] == "0"
        assert int(refused.headers["Retry-After"]) >= 1 and refused.headers["x-ratelimit-remaining-requests"] == "0"
        assert "requests_per_minute" in refused.json()["error"]["message"]
        assert refused.json()["error"]["type"] == "RateLimitError"
        assert complete(router, "ka").status_code == 200  # another tenant is not held back
        assert complete(router, "nobody").status_code == 401
        # tokens: prompt 3 + max_tokens each; 40 a minute
        assert complete(router, "kb", max_tokens=30).status_code == 200
        too_many = complete(router, "kb", max_tokens=30)
        assert too_many.status_code == 429 and "tokens_per_minute" in too_many.json()["error"]["message"]
        assert too_many.headers["x-ratelimit-limit-tokens"] == "40"
        after = _metrics(router)
    for series, grew in [('stagemesh:tenant_requests_refused_total{code="429",reason="requests_per_minute",'
                          'tenant="gamma"}', 1.0),
                         ('stagemesh:tenant_requests_total{finished_reason="length",tenant="gamma"}', 3.0),
                         ('stagemesh:tenant_generation_tokens_total{tenant="alpha"}', 4.0)]:
        assert after.get(series, 0.0) - before.get(series, 0.0) == grew, series


def _metrics(router) -> dict[str, float]:
    """The router's /metrics samples by series (name and labels as exposed)."""
    text = requests.get(f"{router.base_url}/metrics", headers={"x-api-key": "ka"}, timeout=10).text
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            series, _, value = line.rpartition(" ")
            out[series] = float(value)
    return out


class SlowReplica(FakeReplica):
    """Tokens come only while `go` is set: requests stay in flight."""
    go = threading.Event()

    async def _outputs(self, prompt, sampling, num_generated):
        async for out in super()._outputs(prompt, sampling, num_generated):
            while not self.go.is_set():
                await asyncio.sleep(0.01)
            yield out


def hold_one(router) -> threading.Thread:
    """beta's request, started on `router` (over a SlowReplica) and returned once it is on the replica."""
    first = threading.Thread(target=complete, args=(router, "kb", 2))
    first.start()
    for _ in range(1000):
        if router.replica.requests:
            break
        threading.Event().wait(0.01)
    return first


def test_max_concurrency_refuses_a_second_request_while_the_first_runs(model_dir, keys):
    SlowReplica.go.clear()
    with FakeRouter(model_dir, M, tenants=Tenants.from_file(keys), limits=TenantLimits(MemoryWindows()),
                    replica_class=SlowReplica) as router:
        first = hold_one(router)
        second = complete(router, "kb", 2)
        assert second.status_code == 429 and "max_concurrency" in second.json()["error"]["message"]
        SlowReplica.go.set()
        first.join(30)
        assert complete(router, "kb", 2).status_code == 200  # the first ended: room again


@pytest.mark.skipif(not INSTALLED, reason=MISSING)
def test_two_routers_sharing_a_redis_store_count_one_limit(model_dir, keys, tmp_path):
    from router.limits_redis import RedisWindows

    server = RedisServer(tmp_path)
    server.start()
    try:
        with FakeRouter(model_dir, M, tenants=Tenants.from_file(keys), limits=TenantLimits(RedisWindows(server.url))) \
                as one, FakeRouter(model_dir, M, tenants=Tenants.from_file(keys),
                                   limits=TenantLimits(RedisWindows(server.url))) as two:
            codes = [complete(router, "kc").status_code for router in (one, two, one, two)]
            assert codes == [200, 200, 200, 429]
            server.kill()  # the store down: requests pass (and the log says so)
            assert complete(one, "kc").status_code == 200
    finally:
        server.stop()


@pytest.mark.skipif(not INSTALLED, reason=MISSING)
def test_max_concurrency_holds_across_two_routers_sharing_a_redis_store(model_dir, keys, tmp_path):
    from router.limits_redis import RedisSlots, RedisWindows

    server = RedisServer(tmp_path)
    server.start()
    SlowReplica.go.clear()
    limits = lambda: TenantLimits(RedisWindows(server.url), RedisSlots(server.url))  # noqa: E731
    try:
        with FakeRouter(model_dir, M, tenants=Tenants.from_file(keys), limits=limits(), replica_class=SlowReplica) \
                as one, FakeRouter(model_dir, M, tenants=Tenants.from_file(keys), limits=limits()) as two:
            first = hold_one(one)
            second = complete(two, "kb", 2)
            assert second.status_code == 429 and "max_concurrency" in second.json()["error"]["message"]
            SlowReplica.go.set()
            first.join(30)
            assert complete(two, "kb", 2).status_code == 200  # the first ended on the other router: room again
    finally:
        SlowReplica.go.set()
        server.stop()


HOLDER = r"""
import asyncio, sys
from router.limits_redis import RedisSlots

async def main():
    slots = RedisSlots(sys.argv[1], lease_s=float(sys.argv[2]))
    assert await slots.enter("beta", 1) is not None
    print("held", flush=True)
    await asyncio.sleep(600)

asyncio.run(main())
"""


@pytest.mark.skipif(not INSTALLED, reason=MISSING)
def test_a_router_that_dies_holding_places_frees_them_when_their_leases_lapse(tmp_path):
    import subprocess
    import sys
    import time

    from router.limits_redis import RedisSlots

    server = RedisServer(tmp_path)
    server.start()
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, server.url, "2"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"

        async def check() -> float:
            slots = RedisSlots(server.url, lease_s=2.0)
            try:
                await asyncio.sleep(2.5)  # past one lease: the holder renewed its place, which still counts
                assert await slots.enter("beta", 1) is None
                holder.kill()  # the router dies holding it
                holder.wait(10)
                start = time.monotonic()
                while (ticket := await slots.enter("beta", 1)) is None:
                    assert time.monotonic() - start < 10, "the dead router's place never lapsed"
                    await asyncio.sleep(0.1)
                await slots.leave("beta", ticket)
                return time.monotonic() - start
            finally:
                await slots.close()

        assert asyncio.run(check()) <= 2.5  # (within its lease)
    finally:
        holder.kill()
        holder.wait(10)
        server.stop()


def test_routers_sharing_a_port_without_redis_refuse_per_minute_limits(keys):
    from stagemesh.core.errors import StagemeshError

    with pytest.raises(StagemeshError, match="tenant 'beta' has a limit .*, but this router shares"):
        Tenants.from_file(keys, "this router shares its port")


def test_a_tenant_whose_queue_waits_past_the_bound_gets_a_503_and_the_lowest_weight_first(model_dir, keys):
    """--max-queue-wait 10: alpha (weight 2, the largest) sheds past 10 s, gamma (weight 1) past 5 s; beta, with
    nothing waiting, gets in."""
    with FakeRouter(model_dir, M, tenants=Tenants.from_file(keys), max_queue_wait=10.0) as router:
        router.replica.queue_wait = {"alpha": 7.0, "gamma": 7.0}
        assert complete(router, "ka").status_code == 200
        shed = complete(router, "kc")
        assert shed.status_code == 503 and int(shed.headers["Retry-After"]) >= 1
        assert "past 5.0 s" in shed.json()["error"]["message"]
        router.replica.queue_wait = {"alpha": 12.0}
        assert complete(router, "ka").status_code == 503 and complete(router, "kb").status_code == 200


def test_the_scheduler_reports_each_tenants_oldest_wait():
    from scheduler.config import SchedulerConfig
    from scheduler.scheduler import Scheduler
    from stagemesh.core.engine_request import EngineRequest
    from stagemesh.core.sampling_params import SamplingParams

    s = Scheduler(SchedulerConfig(num_kv_blocks=64, block_size=4, max_model_len=64, max_num_seqs=1))
    for i, tenant in enumerate(("alpha", "alpha", "beta")):
        s.add_request(EngineRequest(f"r{i}", [3, 4], SamplingParams(max_tokens=2), tenant=tenant))
    s.requests["r1"].arrival_time -= 30  # alpha's second has waited 30 s
    s.schedule()  # (one of them runs)
    waits = s.stats().queue_wait
    assert set(waits) <= {"alpha", "beta"} and waits["alpha"] >= 30
