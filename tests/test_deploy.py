"""deploy/compose: every compose file is valid, its stagemesh commands parse with our own CLI, its
healthchecks are readiness and its grace periods cover the drain, and the multi-host pair
(compose.head.yaml + compose.worker.yaml) serves across two network namespaces and reports the
worker's stage when it dies. deploy/nginx: routers that are not ready or drain are skipped, POSTs
included, and a stream that started is never sent elsewhere."""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from mesh import Mesh, Router, free_port
from netns import NetnsPair, NetnsUnavailable, clean_env
from stagemesh.entry.cli import build_parser
from stagemesh.core.default_model import DEFAULT_MODEL_NAME
from stagemesh.entry.local_mesh import EXIT_SLACK_S
from tiny_models import with_word_tokenizer

COMPOSE_DIR = Path(__file__).parents[1] / "deploy" / "compose"
NGINX_TEMPLATE = Path(__file__).parents[1] / "deploy" / "nginx" / "stagemesh-lb.conf.template"
COMPOSE_FILES = sorted(COMPOSE_DIR.glob("compose*.yaml"))
# sample values for every variable the files read without a default
SAMPLE_ENV = {"HEAD_NODE_IP": "10.0.0.1", "NODE_IP": "10.0.0.2", "STAGEMESH_INTERNAL_TOKEN": "sample-token-0123456789"}
VARIABLE = re.compile(r"\$\$|\$\{([A-Za-z_]\w*)(?:(:?[-?])([^}]*))?\}|\$([A-Za-z_]\w*)")


def substitute(value, env: dict[str, str]):
    """Compose's variable interpolation (${X}, ${X:-default}, ${X-default}, ${X:?error}, $$) over a YAML tree."""
    if isinstance(value, dict):
        return {k: substitute(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [substitute(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def one(match: re.Match) -> str:
        if match.group(0) == "$$":
            return "$"
        name, op, arg = match.group(1) or match.group(4), match.group(2), match.group(3)
        got = env.get(name)
        missing = not got if op and op.startswith(":") else got is None
        if missing and op in (":-", "-"):
            return arg
        if missing:
            raise KeyError(f"${{{name}}} is not set ({arg or 'no default'})")
        return got

    return VARIABLE.sub(one, value)


def load(path: Path, env: dict[str, str] | None = None) -> dict:
    return substitute(yaml.safe_load(path.read_text()), env or SAMPLE_ENV)


def stagemesh_services(doc: dict) -> dict[str, dict]:
    return {name: svc for name, svc in doc["services"].items() if str(svc.get("image", "")).startswith("stagemesh")}


def parse(command: list[str]) -> argparse.Namespace:
    """Parse a service's command with `stagemesh`'s own parser; SystemExit (with argparse's message) if it is bad."""
    return build_parser(only=command[0]).parse_args(command)


def seconds(duration: str) -> float:
    """A compose duration ("1m30s", "40s") in seconds."""
    parts = re.findall(r"(\d+(?:\.\d+)?)(h|ms|m|s)", duration)
    assert parts and "".join(n + u for n, u in parts) == duration, duration
    return sum(float(n) * {"h": 3600, "m": 60, "s": 1, "ms": 1e-3}[u] for n, u in parts)


def test_every_deployment_is_here():
    names = {p.name for p in COMPOSE_FILES}
    assert {"compose.yaml", "compose.head.yaml", "compose.worker.yaml", "compose.head.cuda.yaml",
            "compose.worker.cuda.yaml", "compose.external-lb.yaml"} <= names
    assert (COMPOSE_DIR / "Dockerfile").is_file() and (COMPOSE_DIR / "nginx.conf").is_file()


@pytest.mark.parametrize("path", COMPOSE_FILES, ids=lambda p: p.name)
def test_docker_compose_accepts_the_file(path):
    binary = shutil.which("docker-compose")
    if binary is None:
        pytest.skip("docker-compose is not installed (`make install` installs Debian's docker-compose as root)")
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMPOSE_")}
    done = subprocess.run([binary, "-f", str(path), "config"], capture_output=True, text=True, timeout=60,
                          env={**env, **SAMPLE_ENV})
    assert done.returncode == 0, f"docker-compose -f {path.name} config:\n{done.stderr}"
    assert "WARNING" not in done.stderr, done.stderr  # e.g. a variable that is neither set nor defaulted
    if "HEAD_NODE_IP" in path.read_text():  # the multi-host files refuse to start without their addresses
        for missing in ("HEAD_NODE_IP", "STAGEMESH_INTERNAL_TOKEN"):  # ... or without the internal token
            bare = {k: v for k, v in {**env, **SAMPLE_ENV}.items() if k != missing}
            done = subprocess.run([binary, "-f", str(path), "config"], capture_output=True, text=True, timeout=60,
                                  env=bare)
            assert done.returncode != 0 and missing in done.stderr, done.stderr


@pytest.mark.parametrize("path", COMPOSE_FILES, ids=lambda p: p.name)
def test_commands_parse_with_the_stagemesh_cli(path):
    services = stagemesh_services(load(path))
    assert services, f"{path.name} runs no stagemesh service"
    for name, svc in services.items():
        command = svc["command"]
        assert isinstance(command, list) and all(isinstance(a, str) for a in command), (name, command)
        assert command[0] in ("router", "scheduler", "stage"), (name, command)
        args = parse(command)
        assert args.host == "0.0.0.0", f"{path.name}: {name} listens on {args.host} only"
        if command[0] != "router":
            assert args.advertise_host, f"{path.name}: {name} has no --advertise-host"
        if command[0] == "stage":
            cuda = ".cuda." in path.name
            assert (args.device, args.handoff) == (("cuda", "nccl") if cuda else ("cpu", "grpc")), (name, command)
        assert "healthcheck" in svc and svc.get("restart"), f"{path.name}: {name} needs a healthcheck and restart"
        # the healthchecks are readiness (README.md: what compose reads them for); Docker's SIGKILL waits
        # for the drain (--shutdown-timeout, given explicitly) and the time to exit
        check = svc["healthcheck"]["test"][-1]
        if command[0] == "router":
            assert re.search(r"/ready'", check) and "/health" not in check, (name, check)
        else:
            assert "HealthCheckRequest()" in check, (name, check)  # service "": readiness
        assert "--shutdown-timeout" in command, f"{path.name}: {name} does not say how long it drains"
        assert seconds(svc["stop_grace_period"]) >= args.shutdown_timeout + EXIT_SLACK_S, (name, svc)


def test_a_misspelled_flag_is_rejected():
    command = stagemesh_services(load(COMPOSE_DIR / "compose.yaml"))["stage0"]["command"]
    parse(command)  # the file's own command is fine
    bogus = [("--kv-cache-memroy" if a == "--kv-cache-memory" else a) for a in command]
    err = io.StringIO()
    with pytest.raises(SystemExit) as exit_info, contextlib.redirect_stderr(err):
        parse(bogus)
    assert exit_info.value.code == 2 and "--kv-cache-memroy" in err.getvalue()
    with pytest.raises(SystemExit), contextlib.redirect_stderr(io.StringIO()):
        parse(["scheduler", "--pipline-parallel-size", "2"])


def test_layers_cover_the_model_and_pipeline_sizes_match():
    for head, workers in (("compose.head.yaml", ["compose.worker.yaml"]), ("compose.yaml", [])):
        services = {}
        for name in [head, *workers]:
            services.update({f"{name}:{k}": v for k, v in stagemesh_services(load(COMPOSE_DIR / name)).items()})
        stages = sorted((parse(s["command"]) for s in services.values() if s["command"][0] == "stage"),
                        key=lambda a: a.stage_index)
        (scheduler,) = [parse(s["command"]) for s in services.values() if s["command"][0] == "scheduler"]
        assert [a.stage_index for a in stages] == list(range(scheduler.pipeline_parallel_size))
        bounds = [tuple(int(x) for x in a.layers.split(":")) for a in stages]
        assert bounds[0][0] == 0 and bounds[-1][1] == 30, bounds
        assert all(b[0] == a[1] for a, b in zip(bounds, bounds[1:])), bounds


def test_nginx_conf_is_valid(tmp_path):
    nginx = shutil.which("nginx")
    if nginx is None:
        pytest.skip("nginx is not installed (`make install` installs nginx-light as root)")
    text = (COMPOSE_DIR / "nginx.conf").read_text()
    assert "server router-a:8000" in text and "server router-b:8000" in text
    conf = tmp_path / "nginx.conf"  # the compose service names resolve only inside compose's network
    conf.write_text(text.replace("router-a", "127.0.0.1").replace("router-b", "127.0.0.2")
                    .replace("events {", f"pid {tmp_path}/nginx.pid;\nevents {{"))
    done = subprocess.run([nginx, "-t", "-q", "-p", str(tmp_path), "-e", str(tmp_path / "error.log"), "-c", str(conf)],
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    # the compose file's nginx and the template for other deployments balance alike
    assert _proxy_directives(text) == _proxy_directives(NGINX_TEMPLATE.read_text())
    assert "proxy_next_upstream error timeout http_503 non_idempotent;" in _proxy_directives(text)


def _proxy_directives(conf: str) -> list[str]:
    """How a server passes requests to the routers (its proxy_* lines, but where nginx keeps temporary files)."""
    return [line.strip() for line in conf.splitlines()
            if line.strip().startswith("proxy_") and not line.strip().startswith("proxy_temp_path")]


# -- two hosts: compose.head.yaml in one network namespace, compose.worker.yaml in another ----------------

def _stagemesh() -> list[str]:
    script = Path(sys.executable).parent / "stagemesh"
    return [str(script)] if script.exists() else [sys.executable, "-m", "stagemesh"]


def _wait(what: str, probe, timeout: float, procs, logs: Path):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        ok, last = probe()
        if ok:
            return last
        for proc in procs:
            if proc.poll() is not None:
                pytest.fail(f"{what}: {' '.join(map(str, proc.args[4:6]))} exited with {proc.returncode}\n"
                            + _tails(logs))
        time.sleep(0.5)
    pytest.fail(f"{what}: not after {timeout:.0f}s; last answer: {last}\n" + _tails(logs))


def _healthcheck(host, svc: dict) -> int:
    """Exit status of a service's compose healthcheck, run inside the host's namespace with our python."""
    kind, *argv = svc["healthcheck"]["test"]
    assert kind == "CMD" and argv[0] == "python", svc["healthcheck"]
    try:
        return subprocess.run(host.argv(sys.executable, *argv[1:]), capture_output=True, timeout=20,
                              env=clean_env()).returncode
    except subprocess.TimeoutExpired:
        return -1


def _tails(logs: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-1500:]}" for p in sorted(logs.glob("*.log")))


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_head_and_worker_files_serve_across_two_namespaces(default_model_dir, tmp_path):
    pair = NetnsPair()
    try:
        pair.__enter__()
    except NetnsUnavailable as err:
        print(f"skipping: {err}")
        pytest.skip(f"cannot make network namespaces: {err}")
    try:
        a, b = pair.a, pair.b
        values = {"HEAD_NODE_IP": a.address, "NODE_IP": b.address, "KV_CACHE_MEMORY": str(64 << 20),
                  "STAGE_THREADS": "1", "STAGEMESH_INTERNAL_TOKEN": os.environ["STAGEMESH_INTERNAL_TOKEN"]}
        head = stagemesh_services(load(COMPOSE_DIR / "compose.head.yaml", values))
        (worker,) = stagemesh_services(load(COMPOSE_DIR / "compose.worker.yaml", values)).values()
        for svc in [*head.values(), worker]:  # the files pass the interface names through from the node
            assert "GLOO_SOCKET_IFNAME" in svc["environment"] and "NCCL_SOCKET_IFNAME" in svc["environment"]
            assert f"STAGEMESH_INTERNAL_TOKEN={values['STAGEMESH_INTERNAL_TOKEN']}" in svc["environment"]
        # the converted default model, as the containers' /cache volume holds it
        env = dict(STAGEMESH_CACHE=str(default_model_dir.parents[1]), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
                   HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
        env_a = clean_env(**env, GLOO_SOCKET_IFNAME=a.ifname)
        env_b = clean_env(**env, GLOO_SOCKET_IFNAME=b.ifname)
        procs = [a.spawn([*_stagemesh(), *head[name]["command"]], env_a, tmp_path / f"head-{name}.log")
                 for name in ("scheduler", "stage0", "router")]
        stage1 = b.spawn([*_stagemesh(), *worker["command"]], env_b, tmp_path / "worker-stage.log")
        procs.append(stage1)

        port = parse(head["router"]["command"]).port
        ready_url, health_url = f"http://{a.address}:{port}/ready", f"http://{a.address}:{port}/health"

        def ready():
            status, body = a.http("GET", ready_url, timeout=5)
            return status == 200, body

        _wait("router ready over the two-node replica", ready, 120, procs, tmp_path)

        chat = {"model": DEFAULT_MODEL_NAME, "temperature": 0, "max_tokens": 20,
                "messages": [{"role": "user", "content": "What is the capital of France?"}]}
        status, body = a.http("POST", f"http://{a.address}:{port}/v1/chat/completions", chat, timeout=60)
        assert status == 200, f"{body}\n{_tails(tmp_path)}"
        answer = body["choices"][0]["message"]["content"]
        assert "Paris" in answer, answer
        print(f"answer across the two namespaces: {answer!r}")
        checks = {**{name: _healthcheck(a, svc) for name, svc in head.items()}, "worker": _healthcheck(b, worker)}
        assert checks == {"scheduler": 0, "stage0": 0, "router": 0, "worker": 0}, f"healthchecks: {checks}"

        stage1.kill()
        stage1.wait(timeout=10)
        stage_address = f"{b.address}:{parse(worker['command']).port}"

        def unready():
            status, body = a.http("GET", ready_url, timeout=5)
            return status == 503, body

        body = _wait("router reports the replica unhealthy", unready, 30, procs[:3], tmp_path)
        (replica,) = body["replicas"]
        assert replica["address"] == f"{a.address}:50051" and replica["healthy"] is False, body
        assert body["ready"] is False and body["draining"] is False, body
        reason = replica["reason"] or ""
        print(f"router /ready after the worker's stage died: {reason}")
        # liveness: the router itself is fine, and says the same about its replica
        status, health = a.http("GET", health_url, timeout=5)
        assert status == 200 and health["replicas"][0]["healthy"] is False, (status, health)
        assert "stage 1" in reason and stage_address in reason, f"the reason does not name the stage: {body}"
        status, err = a.http("POST", f"http://{a.address}:{port}/v1/chat/completions", chat, timeout=30)
        assert status == 503 and "stage 1" in str(err), (status, err)
        # the compose healthchecks (readiness) of the scheduler and the router now fail; stage 0 itself is fine
        checks = {name: _healthcheck(a, svc) for name, svc in head.items()}
        assert checks["stage0"] == 0 and checks["scheduler"] != 0 and checks["router"] != 0, checks
        assert a.http("GET", health_url, timeout=5)[0] == 200  # and the router is still alive
    finally:
        pair.__exit__()


# -- nginx (deploy/nginx's template) in front of routers that are not ready, drain, or die mid-stream -----

M = "llama-tiny"
# per request: its status, the routers nginx tried and what each answered (a refused connection: 502)
UPSTREAM_LOG = 'log_format upstreams "$status|$upstream_addr|$upstream_status";'


def _nginx(prefix: Path, upstreams: str) -> tuple[subprocess.Popen, str]:
    """nginx from the template over `upstreams`, logging which routers it tried for each request."""
    prefix.mkdir()
    port = free_port()
    conf = NGINX_TEMPLATE.read_text().replace("{{PREFIX}}", str(prefix)).replace("{{LISTEN}}", f"127.0.0.1:{port}")
    plain = f"access_log {prefix}/access.log;"
    assert plain in conf
    conf = conf.replace("{{UPSTREAMS}}", upstreams).replace(plain, f"{UPSTREAM_LOG}\n    {plain[:-1]} upstreams;")
    (prefix / "nginx.conf").write_text(conf)
    proc = subprocess.Popen(["nginx", "-p", str(prefix), "-c", str(prefix / "nginx.conf"), "-g", "daemon off;"],
                            stderr=open(prefix / "nginx.out", "wb"))
    deadline = time.monotonic() + 10
    while not _accepts(port):
        assert proc.poll() is None and time.monotonic() < deadline, (prefix / "nginx.out").read_text()
        time.sleep(0.1)
    return proc, f"http://127.0.0.1:{port}"


def _accepts(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _logged(prefix: Path, n: int) -> list[tuple[str, str, str]]:
    """The last n requests nginx logged (it logs a request when it ends)."""
    deadline = time.monotonic() + 5
    while True:
        lines = (prefix / "access.log").read_text().splitlines()
        if len(lines) >= n or time.monotonic() > deadline:
            return [tuple(line.split("|")) for line in lines[-n:]]
        time.sleep(0.1)


def _post(base: str, stream: bool, max_tokens: int = 4):
    import requests

    body = {"model": M, "prompt": [5, 6, 7], "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": stream, **({"stream_options": {"include_usage": True}} if stream else {})}
    return requests.post(f"{base}/v1/completions", json=body, timeout=120, stream=stream)


def _events(lines) -> list[str]:
    """The data of a stream's events, as far as the stream goes."""
    import requests

    data = []
    try:
        for line in lines:
            if line.startswith(b"data: "):
                data.append(line[6:].decode())
    except requests.exceptions.RequestException:  # the stream was cut
        pass
    return data


def _completed(resp) -> int:
    """The completion tokens of a whole answer, streamed or not."""
    assert resp.status_code == 200, resp.text
    if resp.headers["Content-Type"].startswith("text/event-stream"):
        events = _events(resp.iter_lines())
        assert events[-1] == "[DONE]", events[-3:]
        return json.loads(events[-2])["usage"]["completion_tokens"]
    return resp.json()["usage"]["completion_tokens"]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.skipif(shutil.which("nginx") is None, reason="nginx is not installed (make install installs nginx-light)")
def test_nginx_skips_routers_that_are_not_ready_or_drain_and_keeps_a_started_stream(tiny_model_dir, tmp_path):
    model_dir = with_word_tokenizer(tiny_model_dir("llama"), tmp_path / "model")
    served = ("--served-model-name", M)
    with Mesh(model_dir, [4], log_dir=tmp_path) as mesh, \
            Router(model_dir, [mesh.address], served, log_dir=tmp_path) as live, \
            Router(model_dir, [mesh.address], served, log_dir=tmp_path) as draining:
        unready = Router(model_dir, [f"127.0.0.1:{free_port()}"], served, log_dir=tmp_path)  # no scheduler there
        try:
            _wait("a router over no replica is alive", lambda: _status(unready.base_url + "/health", 200), 120,
                  [unready.proc], tmp_path)
            assert _status(unready.base_url + "/ready", 503)[0], "a router over no replica is not ready"
            a, d, u = (f"127.0.0.1:{r.port}" for r in (live, draining, unready))

            # not ready: it answers 503 before any work, and nginx passes the POST, stream or not, to the next
            nginx, base = _nginx(tmp_path / "unready", f"server {u} max_fails=0; server {a} backup;")
            try:
                assert [_completed(_post(base, stream)) for stream in (False, True)] == [4, 4]
            finally:
                nginx.terminate()
                nginx.wait(timeout=10)
            assert _logged(tmp_path / "unready", 2) == [("200", f"{u}, {a}", "503, 200")] * 2

            # draining: its stream goes on to the end through nginx, new connections are refused and the
            # POSTs go to the next router
            nginx, base = _nginx(tmp_path / "draining", f"server {d} max_fails=0; server {a} backup;")
            try:
                long = _post(base, True, max_tokens=480)
                lines = long.iter_lines()
                assert next(line for line in lines if line).startswith(b"data: ")
                draining.proc.send_signal(signal.SIGTERM)
                _wait("the draining router closes its listener", lambda: (not _accepts(draining.port), None), 10,
                      [draining.proc], tmp_path)
                assert [_completed(_post(base, stream)) for stream in (False, True)] == [4, 4]
                assert draining.proc.poll() is None, "the drain ended before the POSTs: the test proves nothing"
                events = _events(lines)
                assert events[-1] == "[DONE]" and json.loads(events[-2])["usage"]["completion_tokens"] == 480
                assert draining.proc.wait(timeout=30) == 0
            finally:
                nginx.terminate()
                nginx.wait(timeout=10)
            assert _logged(tmp_path / "draining", 3) == [("200", f"{d}, {a}", "502, 200")] * 2 + [("200", d, "200")]

            # a stream that started is never passed on, even when its router dies under it
            nginx, base = _nginx(tmp_path / "started", f"server {a} max_fails=0; server {u} backup;")
            try:
                cut = _post(base, True, max_tokens=480)
                lines = cut.iter_lines()
                assert next(line for line in lines if line).startswith(b"data: ")
                live.proc.kill()
                events = _events(lines)
                # chunks already in flight may arrive, each with "usage": null; the end (a usage chunk, [DONE]) never
                assert "[DONE]" not in events and not any(json.loads(e).get("usage") for e in events), events[-3:]
            finally:
                nginx.terminate()
                nginx.wait(timeout=10)
            ((status, tried, _),) = _logged(tmp_path / "started", 1)
            assert (status, tried) == ("200", a), "nginx passed a started stream on"
        finally:
            unready.__exit__(None, None, None)


def _status(url: str, want: int):
    import requests

    try:
        code = requests.get(url, timeout=5).status_code
    except requests.RequestException as err:
        return False, repr(err)
    return code == want, code
