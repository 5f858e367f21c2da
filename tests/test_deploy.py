"""deploy/compose: every compose file is valid, its stagemesh commands parse with our own CLI,
and the multi-host pair (compose.head.yaml + compose.worker.yaml) serves across two network
namespaces and reports the worker's stage when it dies."""
from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from netns import NetnsPair, NetnsUnavailable, clean_env
from stagemesh.cli import build_parser
from stagemesh.core.default_model import DEFAULT_MODEL_NAME

COMPOSE_DIR = Path(__file__).parents[1] / "deploy" / "compose"
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
        health_url = f"http://{a.address}:{port}/health"

        def healthy():
            status, body = a.http("GET", health_url, timeout=5)
            return status == 200, body

        _wait("router healthy over the two-node replica", healthy, 120, procs, tmp_path)

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

        def unhealthy():
            status, body = a.http("GET", health_url, timeout=5)
            return status == 503, body

        body = _wait("router reports the replica unhealthy", unhealthy, 30, procs[:3], tmp_path)
        (replica,) = body["replicas"]
        assert replica["address"] == f"{a.address}:50051" and replica["healthy"] is False, body
        reason = replica["reason"] or ""
        print(f"router /health after the worker's stage died: {reason}")
        assert "stage 1" in reason and stage_address in reason, f"the reason does not name the stage: {body}"
        status, err = a.http("POST", f"http://{a.address}:{port}/v1/chat/completions", chat, timeout=30)
        assert status == 503 and "stage 1" in str(err), (status, err)
        # the compose healthchecks of the scheduler and the router now fail; stage 0 itself is fine
        checks = {name: _healthcheck(a, svc) for name, svc in head.items()}
        assert checks["stage0"] == 0 and checks["scheduler"] != 0 and checks["router"] != 0, checks
    finally:
        pair.__exit__()
