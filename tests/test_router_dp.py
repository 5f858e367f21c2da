"""Data parallelism: `serve --data-parallel-size`, replica failure under load, nginx in front of routers."""
from __future__ import annotations

import shutil
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

from mesh import Mesh, Router, completion_ids, free_port, internal_channel, start_serve
from parity import prompts
from stagemesh.v1 import scheduler_pb2, scheduler_pb2_grpc
from tiny_models import reference_model, reference_tokens, with_word_tokenizer

pytestmark = pytest.mark.slow
M = "llama-tiny"
TEMPLATE = Path(__file__).parents[1] / "deploy" / "nginx" / "stagemesh-lb.conf.template"


def test_serve_tp2_pp2_dp2_matches_transformers(tiny_model_dir, tmp_path):
    """And parallel sampling through serve's router runs a prompt once on one of its two replicas."""
    model_dir = with_word_tokenizer(tiny_model_dir("llama"), tmp_path / "model")
    port = free_port()
    log = tmp_path / "serve.log"
    proc = start_serve([str(model_dir), "-tp", "2", "-pp", "2", "-dp", "2", "--port", str(port), "--grpc-port", "0",
                        "--served-model-name", M, "--threads", "1"], log)
    try:
        base = f"http://127.0.0.1:{port}"
        _wait(lambda: requests.get(f"{base}/health", timeout=2).json()["replicas"], log,
              ok=lambda reps: len(reps) == 2 and all(r["healthy"] for r in reps))
        batch = prompts(384, (5, 40, 17, 33, 9, 51))
        ref = reference_model(model_dir)
        want = [reference_tokens(ref, p, 12) for p in batch]
        with ThreadPoolExecutor(6) as pool:
            got = list(pool.map(lambda p: completion_ids(base, M, p, 12), batch))
        assert got == want
        replicas = requests.get(f"{base}/health", timeout=5).json()["replicas"]
        channels = [internal_channel(r["address"]) for r in replicas]
        try:
            _check_parallel_sampling_runs_a_prompt_once_on_one_replica(
                base, [scheduler_pb2_grpc.SchedulerStub(c) for c in channels])
        finally:
            for c in channels:
                c.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)


def _wait(probe, log, ok, timeout=180):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if ok(probe()):
                return
        except (requests.RequestException, KeyError, ValueError):
            pass
        time.sleep(0.3)
    pytest.fail("not ready:\n" + log.read_text()[-3000:])


def healthy_series(router) -> dict[tuple[str, str], float]:
    """(replica, engine) -> value of every stagemesh:router_replica_healthy series on the router's /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    page = requests.get(f"{router.base_url}/metrics", timeout=10).text
    return {(s.labels["replica"], s.labels["engine"]): s.value for f in text_string_to_metric_families(page)
            if f.name == "stagemesh:router_replica_healthy" for s in f.samples}


def test_killed_replica_gets_no_new_requests_and_waiting_ones_move(tiny_model_dir, tmp_path):
    """And the router's stagemesh:router_replica_healthy has one series per replica from its start (engine: the
    replica's index in --replica), which goes to 0 when the replica fails (its stage, then its scheduler)."""
    model_dir = with_word_tokenizer(tiny_model_dir("llama"), tmp_path / "model")
    args = ("--max-num-seqs", "1", "--stage-recovery-timeout", "1")
    with Mesh(model_dir, [4], scheduler_args=args, log_dir=tmp_path) as a, \
            Mesh(model_dir, [4], scheduler_args=args, log_dir=tmp_path) as b:
        with Router(model_dir, [a.address, b.address], ("--served-model-name", M, "--policy", "round-robin"),
                    log_dir=tmp_path) as router:
            assert healthy_series(router) == {(a.address, "0"): 1.0, (b.address, "1"): 1.0}
            body = {"model": M, "prompt": [5, 6, 7], "max_tokens": 150, "ignore_eos": True}
            with ThreadPoolExecutor(6) as pool:
                futures = [pool.submit(requests.post, f"{router.base_url}/v1/completions", json=body, timeout=120)
                           for _ in range(6)]
                time.sleep(1.0)  # one running and two waiting on each replica
                b.kill_stage(0)
                answers = [f.result() for f in futures]
            # none fails: those waiting for a first token moved to a, the one streaming on b went on there as
            # a continuation once b gave up on its stage (after 1 s)
            assert [r.status_code for r in answers] == [200] * 6, [r.text for r in answers]
            assert [r.json()["usage"]["completion_tokens"] for r in answers] == [150] * 6
            _wait(lambda: requests.get(f"{router.base_url}/health", timeout=2).json()["replicas"],
                  tmp_path / f"router-{router.port}.log", ok=lambda reps: [r["healthy"] for r in reps] == [True, False],
                  timeout=30)
            before = a.stub.GetStats(scheduler_pb2.GetStatsRequest(), timeout=5).prefix_cache_queries
            for _ in range(4):
                assert len(completion_ids(router.base_url, M, [5, 6], 4)) == 4
            # every new request ran on the healthy replica: 4 prompts of 2 tokens looked up there
            assert a.stub.GetStats(scheduler_pb2.GetStatsRequest(), timeout=5).prefix_cache_queries == before + 8
            assert healthy_series(router) == {(a.address, "0"): 1.0, (b.address, "1"): 0.0}
            a.kill_scheduler()
            _wait(lambda: healthy_series(router), tmp_path / f"router-{router.port}.log", timeout=15,
                  ok=lambda got: got == {(a.address, "0"): 0.0, (b.address, "1"): 0.0})


@pytest.mark.skipif(shutil.which("nginx") is None, reason="nginx is not installed (make install installs nginx-light)")
@pytest.mark.parametrize("replicas_per_router", [1, 2], ids=["external", "hybrid"])
def test_nginx_in_front_of_routers(tiny_model_dir, tmp_path, replicas_per_router):
    model_dir = with_word_tokenizer(tiny_model_dir("llama"), tmp_path / "model")
    meshes = [Mesh(model_dir, [4], log_dir=tmp_path) for _ in range(2 * replicas_per_router)]
    port = free_port()
    try:
        for m in meshes:
            m.__enter__()
        groups = [meshes[i:i + replicas_per_router] for i in range(0, len(meshes), replicas_per_router)]
        routers = [Router(model_dir, [m.address for m in g], ("--served-model-name", M), log_dir=tmp_path)
                   for g in groups]
        for r in routers:
            r.__enter__()
        conf = TEMPLATE.read_text().replace("{{PREFIX}}", str(tmp_path)).replace("{{LISTEN}}", f"127.0.0.1:{port}")
        conf = conf.replace("{{UPSTREAMS}}", " ".join(f"server 127.0.0.1:{r.port};" for r in routers))
        (tmp_path / "nginx.conf").write_text(conf)
        nginx = subprocess.Popen(["nginx", "-p", str(tmp_path), "-c", str(tmp_path / "nginx.conf"), "-g",
                                  "daemon off;"], stderr=open(tmp_path / "nginx.out", "wb"))
        try:
            base = f"http://127.0.0.1:{port}"
            _wait(lambda: requests.get(f"{base}/ready", timeout=2).status_code, tmp_path / "nginx.out",
                  ok=lambda code: code == 200, timeout=30)
            ref = reference_model(model_dir)
            batch = prompts(384, (5, 12, 30, 8, 21, 3, 17, 9))
            with ThreadPoolExecutor(8) as pool:
                got = list(pool.map(lambda p: completion_ids(base, M, p, 6), batch))
            assert got == [reference_tokens(ref, p, 6) for p in batch]
            # both routers and every replica took part
            for m in meshes:
                assert m.stub.GetStats(scheduler_pb2.GetStatsRequest(), timeout=5).prefix_cache_queries > 0
        finally:
            nginx.terminate()
            nginx.wait(timeout=10)
        for r in routers:
            r.__exit__(None, None, None)
    finally:
        for m in meshes:
            m.__exit__(None, None, None)


def _check_parallel_sampling_runs_a_prompt_once_on_one_replica(base: str, schedulers: list) -> None:
    """n=4 over two replicas: the choices share their prompt's blocks on one replica (three prefix-cache hits
    of its full blocks) and equal four single requests seeded with the request's seed + their index."""
    prompt = list(range(10, 74))  # 4 full blocks of 16
    body = {"model": M, "prompt": prompt, "max_tokens": 6, "temperature": 1.0, "seed": 21, "ignore_eos": True,
            "return_token_ids": True}
    before = [s.GetStats(scheduler_pb2.GetStatsRequest(), timeout=5) for s in schedulers]
    answer = requests.post(f"{base}/v1/completions", json={**body, "n": 4}, timeout=120).json()
    after = [s.GetStats(scheduler_pb2.GetStatsRequest(), timeout=5) for s in schedulers]
    queried = [y.prefix_cache_queries - x.prefix_cache_queries for x, y in zip(before, after)]
    hits = [y.prefix_cache_hits - x.prefix_cache_hits for x, y in zip(before, after)]
    assert sorted(queried) == [0, 4 * 64] and sorted(hits) == [0, 3 * 48]  # the last block is recomputed
    # the prompt counts once, cached tokens too: none, its first choice computed it (the siblings' hits
    # are its own blocks, not a cache the client had)
    assert answer["usage"] == {"prompt_tokens": 64, "completion_tokens": 24, "total_tokens": 88}
    singles = []
    for i in range(4):
        single = requests.post(f"{base}/v1/completions", json={**body, "seed": 21 + i}, timeout=120)
        singles.append(single.json()["choices"][0]["token_ids"])
    choices = sorted(answer["choices"], key=lambda c: c["index"])
    assert [c["token_ids"] for c in choices] == singles
