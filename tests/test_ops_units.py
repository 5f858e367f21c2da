"""The operations' parts without processes: the autoscaler's hysteresis, the admin file and its discovery, the
refusals of scale and rollout requests, the layout of replicas added later, the router's replica set changing
at run time, the admin API's authentication and refusals (real aiohttp server on loopback), and what a Ray cluster
without room for a replica is told."""
from __future__ import annotations

import argparse
import asyncio
import os
import stat

import pytest

from stagemesh.core.errors import StagemeshError
from stagemesh.entry.ops.autoscale import AutoscaleConfig, AutoscalePolicy, Load
from stagemesh.entry.ops.operation import Refused

CFG = AutoscaleConfig(min_replicas=1, max_replicas=3, target_waiting=4, target_kv_usage=0.8, up_window_s=10,
                      down_window_s=30, cooldown_s=20)


def test_the_autoscaler_grows_only_on_sustained_load_and_waits_out_its_cooldown():
    policy = AutoscalePolicy(CFG)
    busy = Load(replicas=1, waiting=9, kv_usage=0.1)
    assert policy.decide(0, busy) is None
    assert policy.decide(9, busy) is None  # not sustained long enough
    assert policy.decide(9.5, Load(1, 2, 0.1)) is None  # a dip starts the window over
    assert policy.decide(10, busy) is None and policy.decide(19, busy) is None
    grow = policy.decide(20, busy)
    assert grow is not None and grow.replicas == 2 and "9.0 request(s) waiting per replica" in grow.reason
    policy.changed(20)
    two = Load(2, 20, 0.1)
    assert policy.decide(31, two) is None and policy.decide(39, two) is None  # the cooldown (until 40)
    assert policy.decide(41, two).replicas == 3
    policy.changed(41)
    assert policy.decide(100, Load(3, 40, 0.9)) is None  # at --autoscale-max-replicas


def test_the_autoscaler_shrinks_when_one_replica_fewer_stays_under_half_the_targets():
    policy = AutoscalePolicy(CFG)
    assert policy.decide(0, Load(2, 2, 0.1)) is None  # 2 waiting on 1 replica: not under half of 4
    assert policy.decide(100, Load(2, 2, 0.1)) is None
    quiet = Load(2, 1, 0.15)
    assert policy.decide(101, quiet) is None
    assert policy.decide(130, Load(2, 0, 0.3)) is None  # KV: 0.3 x 2 = 0.6 on one, over half of 0.8: starts over
    assert policy.decide(131, quiet) is None and policy.decide(160, quiet) is None
    shrink = policy.decide(161, quiet)
    assert shrink is not None and shrink.replicas == 1 and "one replica fewer" in shrink.reason
    assert AutoscalePolicy(CFG).decide(1000, Load(1, 0, 0.0)) is None  # never below the minimum


def test_the_autoscaler_brings_the_replicas_back_within_its_bounds_at_once():
    policy = AutoscalePolicy(AutoscaleConfig(min_replicas=2, max_replicas=3))
    assert policy.decide(0, Load(1, 0, 0)).replicas == 2
    assert policy.decide(0, Load(5, 0, 0)).replicas == 3


def test_the_admin_file_is_the_users_alone_and_found_by_the_commands(tmp_path, monkeypatch):
    from stagemesh.entry.ops import admin_file

    monkeypatch.setenv("STAGEMESH_CACHE", str(tmp_path))
    monkeypatch.delenv(admin_file.ENV_URL, raising=False)
    monkeypatch.delenv(admin_file.ENV_KEY, raising=False)
    with pytest.raises(StagemeshError, match="no running `stagemesh serve`"):
        admin_file.discover(None, None)
    path = admin_file.write("http://127.0.0.1:1234", "k" * 32)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert admin_file.discover(None, None) == ("http://127.0.0.1:1234", "k" * 32)
    assert admin_file.discover("http://127.0.0.1:1234/", "given") == ("http://127.0.0.1:1234", "given")
    with pytest.raises(StagemeshError, match="no admin key for http://10.0.0.1:9"):
        admin_file.discover("http://10.0.0.1:9", None)
    (path.parent / "serve-999999999.json").write_text('{"url": "http://x:1", "pid": 999999999}')  # its serve is gone
    assert admin_file.discover(None, None)[0] == "http://127.0.0.1:1234"
    (path.parent / f"serve-{os.getppid()}.json").write_text(f'{{"url": "http://y:2", "pid": {os.getppid()}}}')
    with pytest.raises(StagemeshError, match="several `stagemesh serve` run on this host"):
        admin_file.discover(None, None)


def _serve_args(*argv: str) -> argparse.Namespace:
    from stagemesh.entry.serve import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(list(argv))


def _mesh(*argv: str):
    """A serve mesh as planned (nothing started): what the refusals read."""
    from stagemesh.entry.layout import MeshLayout
    from stagemesh.entry.local_mesh import Signals
    from stagemesh.entry.ops.mesh import build

    args = _serve_args(*argv)
    layout = MeshLayout.build(args, "/m", 4, cuda=False, control=True)
    return build(args, layout, {}, Signals(), (None, None), "t" * 32)


def test_scale_and_rollout_refuse_what_the_mesh_cannot_have():
    from stagemesh.entry.ops.rollout import rollout
    from stagemesh.entry.ops.scaling import check_scale, scale

    def refused(call, *args) -> Refused:
        with pytest.raises(Refused) as err:
            call(*args)
        assert err.value.status == 400
        return err.value

    one = _mesh()
    assert "at least one replica" in str(refused(check_scale, one, 0))
    assert "--surge" in str(refused(rollout, one, False))
    assert rollout(one, True).steps[0][0].startswith("add a replica")
    assert [name for name, _ in rollout(_mesh("-dp", "2", "-pp", "2"), False).steps] == [
        "restart stage[0.0]", "restart stage[0.1]", "restart stage[1.0]", "restart stage[1.1]",
        "restart scheduler[0]", "restart scheduler[1]", "restart router"]
    pd = _mesh("-dp", "2", "--prefill-replicas", "1")
    assert "needs 2 replicas at least" in str(refused(check_scale, pd, 1))
    check_scale(pd, 3)
    assert "--enable-expert-parallel" in str(refused(check_scale, _mesh("--enable-expert-parallel"), 2))
    assert "--enable-expert-parallel" in str(refused(rollout, _mesh("-dp", "2", "--enable-expert-parallel"), False))
    assert "between --autoscale-min-replicas 1 and --autoscale-max-replicas 2" in str(
        refused(check_scale, one, 3, (1, 2)))
    assert scale(one, 1, "test") is None
    three = _mesh("-dp", "3")
    assert [n for n, _ in scale(three, 1, "test").steps] == [f"remove {three.replicas[i].name}" for i in (2, 1)]
    assert [n for n, _ in scale(one, 3, "test").steps] == ["add a replica (1 of 2)", "add a replica (2 of 2)"]


def test_the_autoscale_flags_are_checked_before_anything_starts():
    from stagemesh.entry.ops.serve_ops import autoscale_config

    assert autoscale_config(_serve_args()) is None
    assert autoscale_config(_serve_args("--autoscale-max-replicas", "2", "--distributed-executor-backend", "ray"))
    cfg = autoscale_config(_serve_args("--autoscale-max-replicas", "4", "--prefill-replicas", "1", "-dp", "2"))
    assert (cfg.min_replicas, cfg.max_replicas) == (2, 4)
    for bad, says in ((("--autoscale-min-replicas", "2"), "needs --autoscale-max-replicas"),
                      (("--autoscale-max-replicas", "1", "-dp", "2"), "<= --autoscale-max-replicas"),
                      (("--autoscale-max-replicas", "2", "--enable-expert-parallel"), "not built for"),
                      (("--autoscale-max-replicas", "2", "--autoscale-target-kv-usage", "1.5"), "in (0, 1]")):
        with pytest.raises(StagemeshError, match=says.replace("(", r"\(").replace("[", r"\[")):
            autoscale_config(_serve_args(*bad))


def test_a_replica_added_later_has_the_first_ones_command_lines_and_ports_of_its_own():
    from stagemesh.entry.layout import MeshLayout, plan_commands

    args = _serve_args("-dp", "2", "-pp", "2", "--metrics-port", "9000", "--api-server-count", "2")
    layout = MeshLayout.build(args, "/m", 4, cuda=False, control=True)
    flags = lambda argv: dict(zip(argv, argv[1:]))  # noqa: E731
    (_, first), (address, later) = layout.replica(0), layout.replica(2)
    ports = [int(flags(s.argv)["--metrics-port"]) for s in later]
    assert ports == [9007, 9008, 9009]  # replica 1 on 9003-9005, serve's own on 9006 (2 x (2 + 1)), then these
    assert [s.name for s in later] == ["scheduler[2]", "stage[2.0]", "stage[2.1]"]
    assert flags(later[1].argv)["--scheduler"] == address != flags(first[1].argv)["--scheduler"]
    strip = lambda argv: [a for a in argv if not a.isdigit() and ":" not in a]  # noqa: E731
    assert strip(later[1].argv) == strip(first[1].argv)
    routers = layout.routers([address])
    assert [flags(r.argv)["--control-port"] for r in routers] == [str(p) for p in layout.control_ports]
    assert "--control-port" not in plan_commands(args, "/m", 4, cuda=False)[-1].argv  # (serve's own layout only)


def test_the_router_takes_replicas_while_it_serves():
    from prometheus_client import generate_latest

    from router import metrics
    from router.balancing import LeastLoad
    from router.control import checked_replicas
    from router.replica_set import ReplicaSet
    from stagemesh.v1 import router_pb2

    def request(*entries) -> router_pb2.SetReplicasRequest:
        return router_pb2.SetReplicasRequest(replicas=[router_pb2.ReplicaEntry(address=a, cordoned=c)
                                                       for a, c in entries])

    for bad, says in ((request(), "1 to 1024"), (request(("nohost", False)), "not HOST:PORT"),
                      (request(("h:1", False), ("h:1", True)), "listed twice")):
        with pytest.raises(StagemeshError, match=says):
            checked_replicas(bad)

    async def run() -> None:
        replicas = ReplicaSet(["127.0.0.1:1"], LeastLoad())
        await replicas.refresh()  # (a health check: neither answers)
        added, removed = await replicas.set_replicas(checked_replicas(request(("127.0.0.1:1", True),
                                                                              ("127.0.0.1:2", False))))
        assert (added, removed) == (["127.0.0.1:2"], [])
        await replicas.refresh()
        # the router's health series: one per replica, each under an engine label of its own
        series = healthy_series()
        assert sorted(r for r, _ in series) == ["127.0.0.1:1", "127.0.0.1:2"] and len({e for _, e in series}) == 2
        for r in replicas.replicas:
            r.healthy = True
        assert [r.address for r in replicas.healthy()] == ["127.0.0.1:2"]  # the cordoned one gets no new work
        added, removed = await replicas.set_replicas({"127.0.0.1:2": False})
        assert (added, removed) == ([], ["127.0.0.1:1"]) and len(replicas.replicas) == 1
        assert healthy_series() == {k: v for k, v in series.items() if k[0] == "127.0.0.1:2"}  # the removed one's went
        await replicas.close()

    def healthy_series() -> dict[tuple[str, str], float]:
        from prometheus_client.parser import text_string_to_metric_families

        page = generate_latest(metrics.REGISTRY).decode()
        return {(x.labels["replica"], x.labels["engine"]): x.value for f in text_string_to_metric_families(page)
                if f.name == "stagemesh:router_replica_healthy" for x in f.samples
                if x.labels["replica"] in ("127.0.0.1:1", "127.0.0.1:2")}

    asyncio.run(run())


def test_the_admin_api_wants_its_key_and_says_why_it_refuses():
    from aiohttp.test_utils import TestClient, TestServer

    from stagemesh.entry.ops.admin_api import build_app
    from stagemesh.entry.ops.serve_ops import MeshController

    async def run() -> None:
        async with TestClient(TestServer(build_app(MeshController(_mesh()), "secret-key"))) as client:
            assert (await client.get("/admin/status")).status == 401
            assert (await client.get("/admin/status", headers={"Authorization": "Bearer nope"})).status == 403
            ok = {"Authorization": "Bearer secret-key"}
            status = await (await client.get("/admin/status", headers=ok)).json()
            assert status["backend"] == "mp" and status["data_parallel_size"] == 1 and status["operation"] is None
            resp = await client.post("/admin/rollout", json={}, headers=ok)
            assert resp.status == 400 and "--surge" in (await resp.json())["error"]["message"]
            assert (await client.post("/admin/scale", json={"data_parallel_size": "2"}, headers=ok)).status == 400
            assert (await client.post("/admin/scale", data=b"[1]", headers=ok)).status == 400

    asyncio.run(run())


def test_the_admin_api_answers_every_error_in_json_even_those_aiohttp_makes():
    """An unknown path, a wrong method, a body past the bound and a request the HTTP parser refuses each get the
    gateway's JSON error with its own status, never aiohttp's text/plain (a real server on loopback)."""
    import json
    import socket

    import requests

    from stagemesh.entry.ops.admin_api import AdminServer
    from stagemesh.entry.ops.serve_ops import MeshController

    server = AdminServer(MeshController(_mesh()), "secret-key", "127.0.0.1", 0)
    port = server.start()
    base, ok = f"http://127.0.0.1:{port}", {"Authorization": "Bearer secret-key"}

    def check(resp: requests.Response, status: int, words: str) -> None:
        assert resp.status_code == status and resp.headers["Content-Type"].startswith("application/json"), resp.text
        error = resp.json()["error"]
        assert error["code"] == status and words in error["message"], error

    try:
        check(requests.get(f"{base}/admin/nothing", headers=ok, timeout=10), 404, "no route GET /admin/nothing")
        check(requests.get(f"{base}/admin/rollout", headers=ok, timeout=10), 405,
              "GET is not allowed on /admin/rollout")
        check(requests.post(f"{base}/admin/scale", data=b"{" + b" " * 8192 + b"}", headers=ok, timeout=10), 413,
              "Maximum request body size")
        check(requests.get(f"{base}/admin/nothing", timeout=10), 401, "Authorization: Bearer")
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:  # no HTTP client sends this
            sock.sendall(b"GET /admin/status HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n")
            raw = b""
            while chunk := sock.recv(65536):
                raw += chunk
        head, _, body = raw.partition(b"\r\n\r\n")
        assert head.split()[1] == b"400" and b"application/json" in head, raw[:300]
        assert json.loads(body)["error"]["message"].startswith("the request is not valid HTTP"), body
    finally:
        server.stop()


def test_a_ray_cluster_without_room_for_a_replica_says_what_is_missing():
    from stagemesh.entry.layout import ChildSpec
    from stagemesh.entry.ray_room import missing_free_room, missing_room

    stage = ChildSpec("stage[0.0]", [], cpus=2)
    gpu = ChildSpec("stage[0.1]", [], cpus=2, gpus=4)
    free = {"10.0.0.1": {"memory": 1e9}, "10.0.0.2": {"CPU": 3.0, "GPU": 2.0}}
    assert missing_free_room(free, [stage]) is None
    assert missing_free_room(free, [stage, stage]) == (
        "no node of the Ray cluster has CPU 2 free for one of them (free now: node 10.0.0.1: CPU 0; node 10.0.0.2: "
        "CPU 3, GPU 2): add a node, or free room")
    assert "has CPU 2, GPU 4 free" in missing_free_room(free, [gpu])
    nodes = [{"CPU": 4.0}, {"CPU": 4.0, "GPU": 8.0}]
    assert missing_room(nodes, {"CPU": 8.0, "GPU": 8.0}, [gpu, gpu]) is None
    assert "the largest: CPU 4, GPU 8" in missing_room(nodes, {"CPU": 8.0, "GPU": 8.0},
                                                         [ChildSpec("s", [], cpus=8)])
    assert "the stages need CPU 10, GPU 20 in all" in missing_room(nodes, {"CPU": 8.0, "GPU": 8.0}, [gpu] * 5)
