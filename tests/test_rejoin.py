"""A service restarted with the same command rejoins by itself: a killed stage (same port), a killed
scheduler whose stages kept running, and under `serve -dp 2` a dead stage that serve restarts while the
other replica serves throughout."""
from __future__ import annotations

import os
import re
import signal
import time

from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import requests

from mesh import Mesh, free_port, start_serve
from stagemesh.core.sampling_params import SamplingParams
from stagemesh.v1 import scheduler_pb2
from tiny_models import with_word_tokenizer

pytestmark = pytest.mark.slow
ASK = SamplingParams(max_tokens=6, ignore_eos=True)


def serves_within(mesh: Mesh, seconds: float, name: str) -> float:
    start = time.monotonic()
    mesh.wait_healthy(timeout=seconds)
    tokens, _ = mesh.submit(name, [5, 6, 7], ASK, timeout=max(seconds - (time.monotonic() - start), 5))
    assert len(tokens) == 6
    return time.monotonic() - start


@pytest.mark.parametrize("handoff", ["nccl", "grpc"])
def test_a_killed_stage_and_then_a_killed_scheduler_rejoin_when_restarted(tiny_model_dir, tmp_path, handoff):
    """One mesh, two faults in turn: a stage killed and restarted on its port rejoins; then the scheduler is
    killed mid-stream, and restarted it gets its running stages back (the rejoined one among them)."""
    port = free_port()
    with Mesh(tiny_model_dir("llama"), [2, 2], handoff=handoff, per_stage_args={1: ["--port", str(port)]},
              log_dir=tmp_path) as mesh:
        _a_stage_killed_and_restarted_on_its_port_rejoins(mesh)
        _a_scheduler_killed_mid_stream_gets_its_running_stages_back(mesh)


def _a_stage_killed_and_restarted_on_its_port_rejoins(mesh: Mesh) -> None:
    assert len(mesh.submit("before", [5, 6, 7], ASK)[0]) == 6
    mesh.kill_stage(1)
    mesh.wait_healthy(timeout=30, healthy=False)
    mesh.start_stage(1)  # the same command: the same port
    assert serves_within(mesh, 30, "after") < 30


def _a_scheduler_killed_mid_stream_gets_its_running_stages_back(mesh: Mesh) -> None:
    stages = [proc.pid for proc in mesh.stages]
    long = SamplingParams(max_tokens=400, ignore_eos=True)
    with ThreadPoolExecutor(4) as pool:  # steps in flight when it dies: their RPCs are cancelled
        streams = [pool.submit(mesh.submit, f"r{i}", [5 + i] * 20, long, 60) for i in range(4)]
        while mesh.stub.GetStats(scheduler_pb2.GetStatsRequest(), timeout=5).num_running < 4:
            time.sleep(0.05)
        mesh.kill_scheduler()
        for s in streams:
            with pytest.raises(grpc.RpcError):
                s.result(timeout=60)
    mesh.start_scheduler()
    assert serves_within(mesh, 30, "after-scheduler") < 30
    assert [proc.pid for proc in mesh.stages] == stages and all(p.poll() is None for p in mesh.stages)


def _replicas(base: str) -> list[dict]:
    try:
        return requests.get(f"{base}/health", timeout=2).json()["replicas"]
    except (requests.RequestException, ValueError):
        return []


def _until(predicate, timeout: float, what: str, log) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    pytest.fail(f"{what} within {timeout}s:\n{log.read_text()[-4000:]}")


def test_serve_restarts_a_dead_stage_while_the_other_replica_serves(tiny_model_dir, tmp_path):
    model_dir = with_word_tokenizer(tiny_model_dir("llama"), tmp_path / "model")
    port, log = free_port(), tmp_path / "serve.log"
    proc = start_serve([str(model_dir), "-dp", "2", "-pp", "2", "--handoff", "grpc", "--port", str(port),
                        "--grpc-port", "0", "--threads", "1"], log)
    base = f"http://127.0.0.1:{port}"
    body = {"model": str(model_dir), "prompt": [5, 6, 7], "max_tokens": 4, "ignore_eos": True}
    try:
        _until(lambda: [r["healthy"] for r in _replicas(base)] == [True, True], 180, "two healthy replicas", log)
        router_pid = int(re.search(r"started router \(pid (\d+)\)", log.read_text()).group(1))
        stage_pid = int(re.search(r"started stage\[0\.1\] \(pid (\d+)\)", log.read_text()).group(1))
        os.kill(stage_pid, signal.SIGKILL)
        _until(lambda: [r["healthy"] for r in _replicas(base)] == [False, True], 30, "replica 0 taken out", log)
        for _ in range(4):  # the other replica serves meanwhile
            resp = requests.post(f"{base}/v1/completions", json=body, timeout=60)
            assert resp.status_code == 200, resp.text
        _until(lambda: len(re.findall(r"started stage\[0\.1\]", log.read_text())) == 2, 30, "stage restarted", log)
        _until(lambda: [r["healthy"] for r in _replicas(base)] == [True, True], 60, "replica 0 back", log)
        assert proc.poll() is None and f"started router (pid {router_pid})" in log.read_text()
        assert "stage[0.1] exited with code -9; restarting it" in log.read_text()
        assert len(re.findall(r"started router", log.read_text())) == 1
        assert requests.post(f"{base}/v1/completions", json=body, timeout=60).status_code == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
