"""`stagemesh serve --distributed-executor-backend ray` on a Ray cluster the test makes itself: three
`ray start` nodes (a head and two workers, one CPU each) in three network namespaces on one Ethernet
segment. serve's operations under looping streams: a replica added (its stage in a placement group of its
own), a rolling restart of every service, the replica removed, a scale the cluster has no room for refused;
every answer token-exact. Each stage of a PP=2 mesh lands on a node of its own and the answers are
transformers' greedy tokens; a worker node that holds a stage is killed outright under 8 streams, Ray places
the stage again on the node that has room, and every stream ends with exactly the undisturbed tokens; then the
driver (serve) is SIGKILLed under load and no service it ran on any node outlives it."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from netns import NetnsLan, NetnsUnavailable, clean_env
from netns_ops import NetnsLoad, admin, command
from ops_mesh import metrics_dirs
from parity import prompts
from tiny_models import greedy_tokens, with_word_tokenizer

NEW_TOKENS = 160  # per stream: the node dies well before the end
OPS_TOKENS = 48  # per request of the operations' looping streams
ROLLED = ["stage[0.0]", "stage[1.0]", "scheduler[0]", "scheduler[1]", "router[0]", "router[1]"]
COOLDOWN_S = 20  # the autoscaler's after the scale-out: longer than the gap before the rollout (which it waits out)
LENGTHS = (5, 40, 17, 70, 3, 33, 9, 51)
GCS_PORT = 6379
# Ray declares a node dead after this many missed health checks of this period (default 5 x 3 s)
FAST_HEALTH_CHECKS = {"RAY_health_check_period_ms": "1000", "RAY_health_check_failure_threshold": "3"}


def test_serve_on_ray_refuses_clearly_when_no_cluster_answers(tmp_path):
    from mesh import free_port

    port = free_port()  # nothing listens there
    for address, says in ((f"127.0.0.1:{port}", "no Ray cluster answers at"), ("ray://127.0.0.1:10001",
                                                                             "a Ray Client address")):
        done = subprocess.run([sys.executable, "-m", "stagemesh", "serve", "--distributed-executor-backend", "ray"],
                              capture_output=True, text=True, timeout=120, env={**os.environ, "RAY_ADDRESS": address})
        assert done.returncode == 2, done.stderr
        assert says in done.stderr and "RAY_ADDRESS" in done.stderr, done.stderr
        assert "Traceback" not in done.stderr, done.stderr


class NotRay:
    """A TCP server that is not Ray: it accepts, answers every connection with an HTTP error, and counts them."""

    def __init__(self, host: str):
        import socket
        import threading

        self.sock = socket.create_server((host, 0))
        self.address = f"{host}:{self.sock.getsockname()[1]}"
        self.connections = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:  # closed
                return
            self.connections += 1
            try:
                conn.sendall(b"HTTP/1.0 400 Bad Request\r\n\r\nnot Ray\n")
            except OSError:
                pass
            finally:
                conn.close()

    def close(self) -> None:
        self.sock.close()


def _not_loopback_address() -> str:
    """An address of this host that Ray keeps as given (it turns 127.0.0.1 into the node's address)."""
    import ipaddress

    import psutil

    for addresses in psutil.net_if_addrs().values():
        for a in addresses:
            if a.family.name == "AF_INET" and not ipaddress.ip_address(a.address).is_loopback:
                return a.address
    pytest.skip("this host has no non-loopback IPv4 address")


def _serve_on_ray_at(address: str, log_path: Path) -> subprocess.Popen:
    with open(log_path, "wb") as log:
        return subprocess.Popen([sys.executable, "-m", "stagemesh", "serve", "--distributed-executor-backend", "ray"],
                                stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "RAY_ADDRESS": address})


@pytest.mark.slow
def test_serve_on_ray_at_a_server_that_is_not_ray_exits_clearly_and_hears_sigterm(tmp_path):
    """ray.init at an address that accepts connections but is not a Ray GCS retries for ever and does not hear
    SIGTERM: serve refuses within 30 s, naming the address and RAY_ADDRESS, and a SIGTERM meanwhile ends it
    within 10 s."""
    pytest.importorskip("ray", reason="Ray is not installed (the dev extras install it: make install)")
    host = _not_loopback_address()
    servers = [NotRay(host), NotRay(host)]
    refused, stopped = (_serve_on_ray_at(server.address, tmp_path / f"{name}.log")
                        for server, name in zip(servers, ("refused", "stopped")))
    started = time.monotonic()
    try:
        deadline = started + 30
        while servers[1].connections < 2 and time.monotonic() < deadline:  # its TCP probe, then a call
            time.sleep(0.1)
        time.sleep(1)
        stopped.send_signal(signal.SIGTERM)
        assert stopped.wait(timeout=10) == 0, (tmp_path / "stopped.log").read_text()
        assert refused.wait(timeout=max(30 - (time.monotonic() - started), 1)) == 2
        out = (tmp_path / "refused.log").read_text()
        assert (f"--distributed-executor-backend ray: {servers[0].address} (from RAY_ADDRESS) does not answer as a "
                "Ray cluster's GCS within 10s") in out, out
        assert "give RAY_ADDRESS the head node's GCS address" in out and "Traceback" not in out, out
    finally:
        for proc in (refused, stopped):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for server in servers:
            server.close()


def _run(host, argv: list[str], env: dict, timeout: float = 120) -> str:
    done = subprocess.run(host.argv(*argv), capture_output=True, text=True, timeout=timeout, env=env)
    assert done.returncode == 0, f"{' '.join(argv)}:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
    return done.stdout


@pytest.fixture(scope="module")
def ray_nodes():
    """Three Ray nodes, each in its own namespace; killed with everything in their namespaces at the end."""
    pytest.importorskip("ray", reason="Ray is not installed (the dev extras install it: make install)")
    lan = NetnsLan(3, subnet="10.78.0", tag=f"r{os.getpid()}")
    try:
        lan.__enter__()
    except NetnsUnavailable as err:
        pytest.skip(f"cannot make network namespaces: {err}")
    ray = str(Path(sys.executable).parent / "ray")
    temp = tempfile.mkdtemp(prefix="smray", dir="/tmp")  # short: Ray's socket paths live under it
    try:
        # the nodes' host name maps to 127.0.1.1 (as Debian's /etc/hosts has it) and no GLOO_SOCKET_IFNAME is set:
        # the stages bind gloo to the interface of their node's Ray address by themselves (issue 43, item 12)
        lan.map_hostname("127.0.1.1")
        head = lan.hosts[0]
        for host in lan.hosts:
            env = {k: v for k, v in clean_env(**FAST_HEALTH_CHECKS, OMP_NUM_THREADS="1",
                                              RAY_USAGE_STATS_ENABLED="0").items() if k != "GLOO_SOCKET_IFNAME"}
            role = (["--head", f"--port={GCS_PORT}", "--include-dashboard=false"] if host is head
                    else [f"--address={head.address}:{GCS_PORT}"])
            # a temp dir per node, as separate machines have: a node's log monitor reads only its own workers
            _run(host, [ray, "start", *role, f"--node-ip-address={host.address}", "--num-cpus=1",
                        "--disable-usage-stats", f"--temp-dir={temp}/{host.address.rsplit('.', 1)[1]}"], env)
        deadline = time.monotonic() + 60
        while _alive_nodes(head) < 3:
            assert time.monotonic() < deadline, "the three Ray nodes did not all join"
            time.sleep(1)
        yield lan
    finally:
        lan.__exit__()
        subprocess.run(["rm", "-rf", temp], timeout=60)


def _alive_nodes(head) -> int:
    code = ("import ray; ray.init(address='auto', logging_level='ERROR'); "
            "print(sum(n['Alive'] for n in ray.nodes()))")
    env = clean_env(RAY_ADDRESS=f"{head.address}:{GCS_PORT}")
    done = subprocess.run(head.argv(sys.executable, "-c", code), capture_output=True, text=True, timeout=60, env=env)
    return int(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else 0


# Runs inside the head's namespace: N streamed completions at once; prints STARTED once each has its first
# tokens, then one JSON line with every stream's token ids and finish reason (or its error).
CLIENT = r"""
import json, sys, threading, urllib.request
url, bodies = sys.argv[1], json.loads(sys.argv[2])
opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
started = threading.Barrier(len(bodies) + 1, timeout=300)
results = [None] * len(bodies)
def one(i):
    ids, finish, waiting = [], None, True
    try:
        req = urllib.request.Request(url, data=json.dumps({**bodies[i], "stream": True}).encode(),
                                     headers={"Content-Type": "application/json"})
        with opener.open(req, timeout=600) as resp:
            for line in resp:
                line = line.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    results[i] = {"error": chunk["error"]}
                    return
                for choice in chunk["choices"]:
                    ids += choice.get("token_ids") or []
                    finish = choice.get("finish_reason") or finish
                if ids and waiting:
                    waiting = False
                    started.wait()
        results[i] = {"ids": ids, "finish": finish}
    except Exception as err:
        results[i] = {"error": repr(err)}
    finally:
        if waiting:
            started.abort()
threads = [threading.Thread(target=one, args=(i,)) for i in range(len(bodies))]
for t in threads:
    t.start()
try:
    started.wait()
    print("STARTED", flush=True)
except threading.BrokenBarrierError:
    print("NOT STARTED", flush=True)
for t in threads:
    t.join()
print(json.dumps(results), flush=True)
"""


def _placement(log: str) -> dict[str, str]:
    """service -> node address, from serve's placement lines."""
    table = log[log.index("placement:"):]
    where = {}
    for node, names in re.findall(r"^\s+node (\S+)(?: \(this node\))?: (.+)$", table, re.M):
        for name in re.findall(r"(router|scheduler\[\d+\]|stage\[\d+\.\d+\])", names):
            where.setdefault(name, node)
    return where


def _wait_replicas(head, base: str, n: int, serve, log_path: Path, timeout: float = 120) -> None:
    """Until the router (either one) balances over exactly n healthy replicas."""
    deadline = time.monotonic() + timeout
    while True:
        status, body = head.http("GET", f"{base}/ready", timeout=5)
        reps = body.get("replicas", []) if isinstance(body, dict) else []
        if status == 200 and len(reps) == n and all(r["healthy"] and not r["cordoned"] for r in reps):
            return
        assert serve.poll() is None and time.monotonic() < deadline, (body, log_path.read_text()[-5000:])
        time.sleep(0.5)


def _wait_autoscaled(head, env: dict, serve, log_path: Path, timeout: float = 120) -> None:
    """Until the autoscaler's scale from 2 replicas to 1 succeeded."""
    deadline = time.monotonic() + timeout
    while True:
        _, status = admin(head, env, "GET", "/admin/status")
        last, decision = status["last_operation"], status["autoscale"]["last_decision"] or ""
        if status["operation"] is None and decision.startswith("2 -> 1") and last["kind"] == "scale":
            assert last["state"] == "succeeded" and status["data_parallel_size"] == 1, status
            return
        assert serve.poll() is None and time.monotonic() < deadline, (status, log_path.read_text()[-5000:])
        time.sleep(0.5)


def _pids(head, env: dict) -> dict[str, int]:
    _, status = admin(head, env, "GET", "/admin/status")
    services = [c for g in status["replicas"] for c in g["children"]] + status["routers"]
    return {c["name"]: c["pid"] for c in services}


# (before the node-death test below, which leaves its serve running and a node dead until the fixture ends)
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_scale_out_rollout_and_autoscaled_scale_in_on_ray_under_4_streams(ray_nodes, tiny_model_dir, tmp_path):
    """1 -> 2 replicas (stagemesh scale), a rolling restart of every service (stagemesh rollout), 2 -> 1 (the
    autoscaler, once its cooldown after the scale-out is over: it finds the load fits one replica), under 4
    looping streams: every answer token-exact, none lost; a scale the cluster has no room for is refused with
    what is free; SIGTERM drains the routers, then the rest."""
    head = ray_nodes.hosts[0]
    model_dir = with_word_tokenizer(tiny_model_dir("llama"), tmp_path / "model")
    batch = prompts(384, LENGTHS)
    want = greedy_tokens(model_dir, batch, OPS_TOKENS)
    log_path = tmp_path / "serve.log"
    env = clean_env(RAY_ADDRESS=f"{head.address}:{GCS_PORT}", GLOO_SOCKET_IFNAME=head.ifname, PYTHONUNBUFFERED="1",
                    STAGEMESH_CACHE=str(tmp_path / "cache"))
    serve = head.spawn([sys.executable, "-m", "stagemesh", "serve", str(model_dir), "--distributed-executor-backend",
                        "ray", "--threads", "1", "--host", head.address, "--port", "8001", "--grpc-port", "0",
                        "--served-model-name", "m", "--kv-cache-memory", str(32 << 20), "--api-server-count", "2",
                        "--shutdown-timeout", "2", "--resume-grace-period", "20", "--autoscale-max-replicas", "4",
                        "--autoscale-scale-down-window", "1", "--autoscale-cooldown", str(COOLDOWN_S),
                        "--autoscale-interval", "0.5"], env, log_path)
    base = f"http://{head.address}:8001"
    _wait_replicas(head, base, 1, serve, log_path)
    code, answer = admin(head, env, "POST", "/admin/rollout", {})
    assert code == 400 and "--surge" in answer["error"]["message"], answer
    with NetnsLoad(head, f"{base}", "m", batch, want, OPS_TOKENS, clients=4) as load:
        scaled = command(head, env, "scale", "--data-parallel-size", "2")
        assert scaled.returncode == 0 and "succeeded" in scaled.stdout, scaled.stdout + log_path.read_text()[-5000:]
        _wait_replicas(head, base, 2, serve, log_path, timeout=30)
        # 3 nodes of one CPU: 2 stages run, 1 CPU is free; 2 replicas more need 2
        code, answer = admin(head, env, "POST", "/admin/scale", {"data_parallel_size": 4})
        assert code == 400 and "no node of the Ray cluster has CPU 1 free" in answer["error"]["message"], answer
        before = _pids(head, env)
        rolled = command(head, env, "rollout")
        assert rolled.returncode == 0 and "succeeded" in rolled.stdout, rolled.stdout + log_path.read_text()[-5000:]
        _wait_autoscaled(head, env, serve, log_path)
        result = load.finish()
    assert "error" not in result, f"{result}\n{log_path.read_text()[-5000:]}"
    _wait_replicas(head, base, 1, serve, log_path, timeout=30)
    after = _pids(head, env)
    log = log_path.read_text()
    order = [m.group(1) for m in re.finditer(r"step \d+/6: restart (\S+)", log)]
    assert order == ROLLED, order
    assert all(after[n] != before[n] for n in after), (before, after)  # scheduler[1] and stage[1.0] are gone
    assert set(after) == {"scheduler[0]", "stage[0.0]", "router[0]", "router[1]"}, after
    serve.send_signal(signal.SIGTERM)
    assert serve.wait(timeout=90) == 0, log_path.read_text()[-5000:]
    log = log_path.read_text()
    assert "drained the routers" in log and "drained the schedulers and stages" in log, log[-3000:]
    assert re.search(r"autoscaler: scaling from 2 to 1 replica\(s\): .*one replica fewer would stay under", log)
    print(f"{result['answered']} answers token-exact, {result['resumed']} resumed stream(s), "
          f"{len(re.findall('continuing it on another replica', log))} continuation(s)")


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_pp2_on_two_ray_nodes_then_a_worker_node_dies_under_8_streams(ray_nodes, tiny_model_dir, tmp_path):
    head, *_ = ray_nodes.hosts
    model_dir = with_word_tokenizer(tiny_model_dir("llama"), tmp_path / "model")
    batch = prompts(384, LENGTHS)
    want = greedy_tokens(model_dir, batch, NEW_TOKENS)
    log_path = tmp_path / "serve.log"
    env = clean_env(RAY_ADDRESS=f"{head.address}:{GCS_PORT}", GLOO_SOCKET_IFNAME=head.ifname, PYTHONUNBUFFERED="1")
    serve = head.spawn([sys.executable, "-m", "stagemesh", "serve", str(model_dir), "--distributed-executor-backend",
                        "ray", "-pp", "2", "--threads", "1", "--host", head.address, "--port", "8000",
                        "--grpc-port", "0", "--served-model-name", "m", "--kv-cache-memory", str(32 << 20)],
                       env, log_path)
    base = f"http://{head.address}:8000"
    deadline = time.monotonic() + 180
    while head.http("GET", f"{base}/ready", timeout=5)[0] != 200:
        assert serve.poll() is None and time.monotonic() < deadline, log_path.read_text()[-5000:]
        time.sleep(0.25)
    log = log_path.read_text()
    where = _placement(log)
    assert where["router"] == where["scheduler[0]"] == head.address, where
    assert where["stage[0.0]"] != where["stage[0.1]"], f"both stages on one node: {where}"

    # PP=2 across two nodes: transformers' greedy tokens
    for prompt, tokens in zip(batch[:3], want):
        status, body = head.http("POST", f"{base}/v1/completions", {
            "model": "m", "prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}, timeout=60)
        assert status == 200, body
        assert body["choices"][0]["token_ids"] == tokens[:24]

    # a worker node that holds a stage dies under 8 streams
    victim_name = next(n for n in ("stage[0.0]", "stage[0.1]") if where[n] != head.address)
    victim = next(h for h in ray_nodes.hosts if h.address == where[victim_name])
    bodies = [{"model": "m", "prompt": p, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True,
               "return_token_ids": True} for p in batch]
    client = subprocess.Popen(head.argv(sys.executable, "-c", CLIENT, f"{base}/v1/completions", json.dumps(bodies)),
                              stdout=subprocess.PIPE, text=True, env=clean_env())
    try:
        assert client.stdout.readline().strip() == "STARTED", client.stdout.read()
        victim.kill_everything()
        out, _ = client.communicate(timeout=300)
    finally:
        if client.poll() is None:
            client.kill()
    results = json.loads(out.strip().splitlines()[-1])
    pattern = re.escape(victim_name) + r" restarted by Ray on node (\S+) \(it ran on (\S+)\)"
    deadline = time.monotonic() + 60  # serve logs the move when it next reads the actor's status
    while not (moved := re.search(pattern, log := log_path.read_text())) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert moved and moved.group(2) == victim.address and moved.group(1) != victim.address, log[-5000:]
    for i, result in enumerate(results):
        assert result == {"ids": want[i], "finish": "length"}, f"stream {i}: {str(result)[:300]}\n{log[-3000:]}"
    print(f"{victim_name} moved from {victim.address} to {moved.group(1)}; 8 streams undisturbed")

    # the driver SIGKILLed under load: Ray ends its actors with it, and every service they ran ends with them
    services = _services_of(model_dir)
    assert len(services) >= 4, services  # the router, the scheduler and the two stages (on their nodes)
    client = subprocess.Popen(head.argv(sys.executable, "-c", CLIENT, f"{base}/v1/completions", json.dumps(bodies)),
                              stdout=subprocess.PIPE, text=True, env=clean_env())
    try:
        assert client.stdout.readline().strip() == "STARTED", client.stdout.read()
        metrics = metrics_dirs(services)  # (serve cannot remove them after a SIGKILL)
        serve.send_signal(signal.SIGKILL)
        serve.wait(timeout=10)
        deadline = time.monotonic() + 60
        while (left := _services_of(model_dir)) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not left, f"services left after the driver's SIGKILL: {left}\n{log_path.read_text()[-3000:]}"
        assert metrics, "the router wrote no metrics"
        for folder in metrics:
            shutil.rmtree(folder)
    finally:
        client.kill()
        client.wait()


def _services_of(model_dir: Path) -> dict[int, str]:
    """pid -> command line of every stagemesh service process serving this model, on any node (the nodes are
    network namespaces of this host: their processes are this host's)."""
    found = {}
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except (FileNotFoundError, ProcessLookupError, NotADirectoryError, PermissionError):
            continue
        line = b" ".join(argv).decode(errors="replace")
        if "-m stagemesh" in line and str(model_dir) in line and " serve " not in line:
            found[int(entry)] = line[:160]
    return found
