"""`stagemesh serve` starts a whole replica and SIGTERM stops every child (healing: tests/test_rejoin.py)."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from contextlib import contextmanager

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from mesh import start_serve
from stagemesh.entry.forkserver import METHOD_ENV
from tiny_models import with_word_tokenizer

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


def parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


SERVE_FLAGS = ("--pipeline-parallel-size", "2", "--handoff", "grpc", "--port", "0", "--grpc-port", "0",
               "--threads", "1")


def start_serve_as_users_do(model_dir, log_path, *extra: str, start_method: str = "spawn"):
    """`python -m stagemesh serve`, as a user starts it: a cold interpreter, whose children start by start_method
    (users' default: spawn). The other tests fork serve warm (mesh.start_serve)."""
    with open(log_path, "wb") as log:
        return subprocess.Popen([sys.executable, "-m", "stagemesh", "serve", str(model_dir), *SERVE_FLAGS, *extra],
                                stdout=log, stderr=subprocess.STDOUT, env={**os.environ, METHOD_ENV: start_method})


@contextmanager
def serving(model_dir, log_path, *extra: str):
    """serve, forked warm (mesh.start_serve); on the way out the process is killed if the test left it running."""
    proc = start_serve([str(model_dir), *SERVE_FLAGS, *extra], log_path)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


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
    with serving(with_word_tokenizer(tiny_model_dir("llama"), tmp_path / "model"), log_path,
                 "--restart-policy", "never") as proc:
        stage_pid = int(wait_for(log_path, r"started stage\[0\.1\] \(pid (\d+)\)").group(1))
        wait_for(log_path, r"joined epoch 1")
        pids = [int(p) for p in re.findall(r"started \S+ \(pid (\d+)\)", log_path.read_text())]
        os.kill(stage_pid, signal.SIGKILL)
        assert proc.wait(timeout=30) == 1
        assert "stage[0.1] exited with code -9; stopping the mesh (--restart-policy never)" in log_path.read_text()
        assert [p for p in pids if alive(p)] == []


@pytest.mark.parametrize("start_method", ["spawn", "forkserver"])
def test_serve_starts_the_replica_and_sigterm_stops_every_child(tiny_model_dir, tmp_path, start_method):
    log_path = tmp_path / "serve.log"
    # (a model with a tokenizer: without one the router exits at start, and the children are not all there)
    proc = start_serve_as_users_do(with_word_tokenizer(tiny_model_dir("llama"), tmp_path / "model"), log_path,
                                   start_method=start_method)
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
                    status = stub.Check(health_pb2.HealthCheckRequest(), timeout=2).status
                    if status == health_pb2.HealthCheckResponse.SERVING:
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
        # spawn: serve is each child's parent; forkserver: a fork server of serve's is (one for the stages'
        # environment, which adds GOMP_SPINCOUNT, another for the scheduler's)
        parents = {pid: parent_of(pid) for pid in pids}
        if start_method == "spawn":
            assert set(parents.values()) == {proc.pid}
        else:
            assert proc.pid not in parents.values() and {parent_of(p) for p in parents.values()} == {proc.pid}
            forkservers = set(parents.values())
        if not {"GOMP_SPINCOUNT", "OMP_WAIT_POLICY"} & os.environ.keys():  # CPU stages share the cores: short spins
            for pid in stage_pids:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    assert b"GOMP_SPINCOUNT=20000" in f.read().split(b"\0")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        assert [p for p in pids if alive(p)] == []
        if start_method == "forkserver":
            assert [p for p in forkservers if alive(p)] == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_serve_passes_the_recovery_and_balancing_flags_to_its_children():
    import argparse

    from stagemesh.entry.serve import add_arguments, plan_commands

    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["-dp", "2", "-pp", "2", "--policy", "cache-aware", "--stage-recovery-timeout", "5",
                         "--max-request-retries", "1", "--scheduling-policy", "priority",
                         "--responses-store", "redis://:pw@10.0.0.5:6379/2", "--responses-store-ttl", "600"])
    children = {c.name: c.argv for c in plan_commands(args, "/m", 4, cuda=False)}
    flags = lambda argv: {a: b for a, b in zip(argv, argv[1:]) if a.startswith("--")}  # noqa: E731
    for r in range(2):
        assert flags(children[f"scheduler[{r}]"]).items() >= {"--stage-recovery-timeout": "5.0",
                                                              "--max-request-retries": "1",
                                                              "--scheduling-policy": "priority"}.items()
    assert flags(children["router"]).items() >= {"--policy": "cache-aware", "--max-request-retries": "1",
                                                 "--responses-store": "redis://:pw@10.0.0.5:6379/2",
                                                 "--responses-store-ttl": "600.0"}.items()
    assert "--policy" not in children["scheduler[0]"] and "--stage-recovery-timeout" not in children["router"]
    assert "--responses-store" not in children["scheduler[0]"] and "--responses-store-size" not in children["router"]


def test_serve_refuses_response_store_flags_that_do_not_go_together_before_any_child_starts():
    from stagemesh.core.errors import StagemeshError
    from stagemesh.entry.serve import _check_layout

    _check_layout(_serve_args("--responses-store", "rediss://:pw@h:6380/1", "--responses-store-ttl", "60"))
    _check_layout(_serve_args("--responses-store-size", "5"))
    with pytest.raises(StagemeshError, match="--responses-store-size bounds the memory store"):
        _check_layout(_serve_args("--responses-store", "redis://h:6379/0", "--responses-store-size", "5"))
    with pytest.raises(StagemeshError, match="--responses-store must be 'memory' or a Redis URL"):
        _check_layout(_serve_args("--responses-store", "h:6379"))


def test_serve_passes_the_chat_template_flags_to_its_router():
    from stagemesh.entry.serve import plan_commands

    trusting = _serve_args("--trust-request-chat-template", "--chat-template-timeout", "3")
    router = next(c.argv for c in plan_commands(trusting, "/m", 4, cuda=False) if c.name == "router")
    assert "--trust-request-chat-template" in router and router[router.index("--chat-template-timeout") + 1] == "3.0"
    router = next(c.argv for c in plan_commands(_serve_args(), "/m", 4, cuda=False) if c.name == "router")
    assert "--trust-request-chat-template" not in router and "--chat-template-timeout" not in router


def _serve_args(*argv: str):
    import argparse

    from stagemesh.entry.serve import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(list(argv))


def test_on_ray_the_stages_listen_on_their_node_and_ask_for_their_ranks_resources():
    from stagemesh.entry.ray_actor import NODE_IP
    from stagemesh.entry.serve import Addresses, plan_commands

    args = _serve_args("-dp", "2", "-pp", "2", "-tp", "4", "--distributed-executor-backend", "ray")
    specs = plan_commands(args, None, 8, cuda=True, addresses=Addresses("127.0.0.2", NODE_IP))
    flags = lambda argv: dict(zip(argv, argv[1:]))  # noqa: E731
    schedulers = [s for s in specs if s.kind == "scheduler"]
    stages = [s for s in specs if s.kind == "stage"]
    (router,) = [s for s in specs if s.kind == "router"]
    assert len(schedulers) == 2 and len(stages) == 4
    for s in schedulers:  # on the head node, where the stages of every node reach them
        assert flags(s.argv)["--host"] == flags(s.argv)["--advertise-host"] == "127.0.0.2" and s.cpus == 0
    for s in stages:
        f = flags(s.argv)
        assert f["--host"] == f["--advertise-host"] == NODE_IP
        assert f["--scheduler"].startswith("127.0.0.2:") and f["--threads"] == "1"
        assert (s.cpus, s.gpus) == (4, 4) and "CUDA_VISIBLE_DEVICES" not in s.env  # Ray assigns the GPUs
        assert s.argv[1] == "--scheduler"  # no model: each node resolves the embedded model itself
    replicas = {router.argv[i + 1] for i, a in enumerate(router.argv) if a == "--replica"}
    assert len(replicas) == 2 and replicas == {flags(s.argv)["--scheduler"] for s in stages}
    # mp: the same mesh on loopback, GPUs handed out in order
    local = plan_commands(args, "/m", 8, cuda=True)
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in local if s.kind == "stage"] == ["0,1,2,3", "4,5,6,7",
                                                                                   "8,9,10,11", "12,13,14,15"]
    assert all("--host" not in s.argv for s in local if s.kind != "router")


def test_serve_on_ray_refuses_experts_across_replicas(tiny_model_dir):
    from stagemesh.core.errors import StagemeshError
    from stagemesh.core.model_config import ModelConfig
    from stagemesh.entry.serve import _check_expert_parallel

    cfg = ModelConfig.from_path(tiny_model_dir("qwen2_moe"))
    args = _serve_args("-dp", "2", "--enable-expert-parallel", "--distributed-executor-backend", "ray")
    with pytest.raises(StagemeshError, match="not built for --distributed-executor-backend ray"):
        _check_expert_parallel(cfg, args, cuda=False, ray=True)


def test_serve_splits_its_replicas_into_prefill_and_decode_ones():
    from stagemesh.core.errors import StagemeshError
    from stagemesh.entry.serve import _check_layout, plan_commands

    args = _serve_args("-dp", "3", "--prefill-replicas", "1")
    schedulers = [s.argv for s in plan_commands(args, "/m", 4, cuda=False) if s.kind == "scheduler"]
    roles = [argv[argv.index("--kv-role") + 1] for argv in schedulers]
    assert roles == ["prefill", "decode", "decode"]
    # every decode replica may fetch KV from the prefill replica's scheduler, and from no other
    prefill = f"127.0.0.1:{schedulers[0][schedulers[0].index('--port') + 1]}"
    assert [[argv[i + 1] for i, flag in enumerate(argv) if flag == "--kv-peer"] for argv in schedulers] == \
        [[], [prefill], [prefill]]
    assert all("--kv-role" not in s.argv for s in plan_commands(_serve_args("-dp", "2"), "/m", 4, cuda=False))
    # without prefill replicas, each replica may read the others' KV (a draining one's requests move with it)
    plain = [s.argv for s in plan_commands(_serve_args("-dp", "3"), "/m", 4, cuda=False) if s.kind == "scheduler"]
    ports = [f"127.0.0.1:{argv[argv.index('--port') + 1]}" for argv in plain]
    assert [[argv[i + 1] for i, flag in enumerate(argv) if flag == "--kv-peer"] for argv in plain] == \
        [[p for p in ports if p != own] for own in ports]
    # the decode replicas' kv_load_failure_policy and the bound on a load: at their defaults (vLLM's fail, 10 s) a
    # child is given nothing (its own declaration of the flag has the same default); else serve's values
    assert not [a for argv in schedulers for a in argv if a.startswith("--kv-load")]
    args = _serve_args("-dp", "2", "--prefill-replicas", "1", "--kv-load-failure-policy", "recompute",
                       "--kv-load-timeout", "3")
    decode = [s.argv for s in plan_commands(args, "/m", 4, cuda=False) if s.kind == "scheduler"][1]
    assert decode[decode.index("--kv-load-failure-policy"):][:4] == ["--kv-load-failure-policy", "recompute",
                                                                    "--kv-load-timeout", "3.0"]
    for bad in (("--prefill-replicas", "1"), ("-dp", "2", "--prefill-replicas", "2")):
        with pytest.raises(StagemeshError, match="needs a decode replica too"):
            _check_layout(_serve_args(*bad))


def test_a_schedulers_kv_peers_are_checked_by_flag():
    from scheduler.cli import _check_kv_peers
    from stagemesh.core.errors import StagemeshError

    _check_kv_peers(["127.0.0.1:5000", "prefill-0.mesh:5000"], "decode")
    for peers, role, words in ((["127.0.0.1"], "decode", "--kv-peer takes a prefill replica's scheduler as HOST:PORT; "
                                                         "got '127.0.0.1'"),
                               ([":5000"], "both", "HOST:PORT; got ':5000'"),
                               (["127.0.0.1:5000"], "prefill", "--kv-peer is for a replica that fetches KV")):
        with pytest.raises(StagemeshError, match=re.escape(words)):
            _check_kv_peers(peers, role)


def test_serve_exits_2_with_vllms_message_when_max_model_len_exceeds_the_kv_cache(tiny_model_dir, tmp_path):
    """Each stage of the tiny llama (2 layers, 2 KV heads of 16, fp32) holds 8 blocks of 16 tokens in 64 KiB:
    128 tokens, far below a --max-model-len of 512. serve stops with code 2 and says so, vLLM's way, rather than
    logging an error every probe for ever."""
    log_path = tmp_path / "serve.log"
    model = with_word_tokenizer(tiny_model_dir("llama"), tmp_path / "model")  # (a router that starts cleanly)
    with serving(model, log_path, "--kv-cache-memory", str(64 * 1024),
                 "--max-model-len", "512") as proc:
        try:
            code = proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            pytest.fail("serve did not exit:\n" + log_path.read_text()[-3000:])
    out = log_path.read_text()
    assert code == 2, out[-3000:]
    assert ("The model's max seq len (512) is larger than the maximum number of tokens that can be stored in KV "
            "cache (128). Based on the available memory, the estimated maximum model length is 128. Try increasing "
            "--kv-cache-memory (or --gpu-memory-utilization on GPUs) or decreasing --max-model-len.") in out, out
    assert out.count("is larger than the maximum number of tokens") == 1, out  # said once, not every probe
    assert "Traceback" not in out, out
