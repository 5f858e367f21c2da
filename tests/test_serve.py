"""`stagemesh serve` starts a whole replica and SIGTERM stops every child (healing: tests/test_rejoin.py)."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

pytestmark = pytest.mark.slow


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is gone for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def start_serve(model_dir, log_path, *extra: str):
    with open(log_path, "wb") as log:
        return subprocess.Popen([sys.executable, "-m", "stagemesh", "serve", str(model_dir),
                                 "--pipeline-parallel-size", "2", "--handoff", "grpc", "--port", "0", "--grpc-port", "0",
                                 "--threads", "1", *extra], stdout=log, stderr=subprocess.STDOUT)


def wait_for(log_path, pattern: str, timeout: float = 120) -> re.Match:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        match = re.search(pattern, log_path.read_text())
        if match:
            return match
        time.sleep(0.2)
    pytest.fail(f"{pattern!r} never appeared:\n{log_path.read_text()}")


def test_with_restart_policy_never_a_child_that_dies_stops_the_mesh(tiny_model_dir, tmp_path):
    log_path = tmp_path / "serve.log"
    proc = start_serve(tiny_model_dir("llama"), log_path, "--restart-policy", "never")
    try:
        stage_pid = int(wait_for(log_path, r"started stage\[0\.1\] \(pid (\d+)\)").group(1))
        wait_for(log_path, r"joined epoch 1")
        pids = [int(p) for p in re.findall(r"started \S+ \(pid (\d+)\)", log_path.read_text())]
        os.kill(stage_pid, signal.SIGKILL)
        assert proc.wait(timeout=30) == 1
        assert "stage[0.1] exited with code -9; stopping the mesh (--restart-policy never)" in log_path.read_text()
        assert [p for p in pids if alive(p)] == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_serve_starts_the_replica_and_sigterm_stops_every_child(tiny_model_dir, tmp_path):
    log_path = tmp_path / "serve.log"
    proc = start_serve(tiny_model_dir("llama"), log_path)
    try:
        deadline = time.monotonic() + 120
        address = None
        while time.monotonic() < deadline and address is None:
            match = re.search(r"started scheduler\[0\] .*--port (\d+)", log_path.read_text())
            address = f"127.0.0.1:{match.group(1)}" if match else None
            time.sleep(0.2)
        assert address, log_path.read_text()
        with grpc.insecure_channel(address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() < deadline:
                try:
                    if stub.Check(health_pb2.HealthCheckRequest(), timeout=2).status == health_pb2.HealthCheckResponse.SERVING:
                        break
                except grpc.RpcError:
                    pass
                time.sleep(0.3)
            else:
                pytest.fail("the replica did not become healthy:\n" + log_path.read_text())
        pids = [int(p) for p in re.findall(r"started \S+ \(pid (\d+)\)", log_path.read_text())]
        assert len(pids) >= 3  # a scheduler and two stages (and the router once it exists)
        stage_pids = [int(p) for p in re.findall(r"started stage\[\S+\] \(pid (\d+)\)", log_path.read_text())]
        assert len(stage_pids) == 2
        if not {"GOMP_SPINCOUNT", "OMP_WAIT_POLICY"} & os.environ.keys():  # CPU stages share the cores: short spins
            for pid in stage_pids:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    assert b"GOMP_SPINCOUNT=20000" in f.read().split(b"\0")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        assert [p for p in pids if alive(p)] == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_serve_passes_the_recovery_and_balancing_flags_to_its_children():
    import argparse

    from stagemesh.serve import add_arguments, plan_commands

    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["-dp", "2", "-pp", "2", "--policy", "cache-aware", "--stage-recovery-timeout", "5",
                         "--max-request-retries", "1", "--scheduling-policy", "priority"])
    children = {name: argv for name, argv, _ in plan_commands(args, "/m", 4, cuda=False)}
    flags = lambda argv: {a: b for a, b in zip(argv, argv[1:]) if a.startswith("--")}  # noqa: E731
    for r in range(2):
        assert flags(children[f"scheduler[{r}]"]).items() >= {"--stage-recovery-timeout": "5.0",
                                                              "--max-request-retries": "1",
                                                              "--scheduling-policy": "priority"}.items()
    assert flags(children["router"]).items() >= {"--policy": "cache-aware", "--max-request-retries": "1"}.items()
    assert "--policy" not in children["scheduler[0]"] and "--stage-recovery-timeout" not in children["router"]
