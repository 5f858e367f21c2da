"""deploy/kubernetes: every object validates against a pinned Kubernetes version's schemas
(kubernetes-validate, strict); every stagemesh command in them parses with our own CLI; the pieces fit
together (stage count and split, addresses and ports, probes, grace periods that cover the drain, the
internal token's Secret, GPUs per stage, Ray's version and room for the stages); and the KubeRay head and
worker commands, run as KubeRay runs them, serve across three network namespaces and stop cleanly on
SIGTERM."""
from __future__ import annotations

import argparse
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from netns import NetnsLan, NetnsUnavailable, clean_env
from stagemesh.entry.cli import build_parser
from stagemesh.core.default_model import DEFAULT_MODEL_NAME
from stagemesh.core.health import LIVENESS
from stagemesh.entry.local_mesh import EXIT_SLACK_S

ROOT = Path(__file__).parents[1]
KUBE_DIR = ROOT / "deploy" / "kubernetes"
MANIFESTS = sorted(KUBE_DIR.rglob("*.yaml"))
KUBERNETES_VERSION = "1.33.0"  # the oldest release the manifests promise to work on
SAMPLE_ENV = {"STAGE_INDEX": "1", "POD_IP": "10.1.2.3"}  # what the downward API gives a pod


def docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def by_kind(path: Path, kind: str) -> list[dict]:
    return [d for d in docs(path) if d["kind"] == kind]


def pod_templates(doc: dict) -> list[dict]:
    """The pod templates of a workload or of a RayCluster's head and worker groups."""
    if doc["kind"] == "RayCluster":
        spec = doc["spec"]
        return [spec["headGroupSpec"]["template"], *(g["template"] for g in spec["workerGroupSpecs"])]
    if doc["kind"] in ("Deployment", "StatefulSet"):
        return [doc["spec"]["template"]]
    return []


def stagemesh_containers(doc: dict) -> list[dict]:
    return [c for t in pod_templates(doc) for c in t["spec"]["containers"] if c["image"].startswith("stagemesh:")]


def expand(arg: str, container: dict) -> str:
    """Kubernetes' $(VAR) expansion in args, with what the pod's env would hold."""
    names = {e["name"] for e in container.get("env", [])}
    return re.sub(r"\$\((\w+)\)", lambda m: SAMPLE_ENV[m.group(1)] if m.group(1) in names else m.group(0), arg)


def parse(argv: list[str]) -> argparse.Namespace:
    return build_parser(only=argv[0]).parse_args(argv)


def serve_command(container: dict) -> list[str]:
    """The `stagemesh serve ...` line of a KubeRay head's script, as argv after `stagemesh`."""
    script = container["args"][0].replace("\\\n", " ")
    (line,) = [ln for ln in script.splitlines() if ln.strip().startswith("stagemesh serve")]
    return shlex.split(line.strip().rstrip("&"))[1:]


def test_every_manifest_is_here():
    names = {str(p.relative_to(KUBE_DIR)) for p in MANIFESTS}
    assert names == {"mp/stagemesh.yaml", "mp/stagemesh.cuda.yaml", "kuberay/raycluster.yaml",
                     "kuberay/raycluster.cuda.yaml", "hpa/stagemesh-serve-hpa.yaml"}
    assert (KUBE_DIR / "README.md").is_file()


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: str(p.relative_to(KUBE_DIR)))
def test_every_object_validates_against_the_pinned_kubernetes(path):
    import kubernetes_validate

    for doc in docs(path):
        if doc["kind"] == "RayCluster":  # a custom resource: its pods are core PodTemplateSpecs
            for template in pod_templates(doc):
                kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"},
                                              "template": template}, KUBERNETES_VERSION, strict=True)
        else:
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_the_validation_can_fail():
    import kubernetes_validate

    (deployment, *_) = by_kind(KUBE_DIR / "mp" / "stagemesh.yaml", "Deployment")
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grpcc"] = {"port": 1}
    with pytest.raises(kubernetes_validate.ValidationError, match="grpcc"):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: str(p.relative_to(KUBE_DIR)))
def test_commands_parse_and_every_service_has_the_internal_token(path):
    for doc in docs(path):
        for container in stagemesh_containers(doc):
            if doc["kind"] == "RayCluster":
                if container["name"] == "ray-head":
                    args = parse(serve_command(container))
                    assert args.distributed_executor_backend == "ray"
                    assert args.host == "0.0.0.0"
                continue
            args = parse([expand(a, container) for a in container["args"]])
            assert args.host == "0.0.0.0", f"{path.name}: {container['name']} listens on {args.host} only"
            tokens = [e for e in container["env"] if e["name"] == "STAGEMESH_INTERNAL_TOKEN"]
            assert tokens and tokens[0]["valueFrom"]["secretKeyRef"] == {"name": "stagemesh-internal-token",
                                                                         "key": "token"}, container["name"]
        if doc["kind"] == "RayCluster":
            (head,) = doc["spec"]["headGroupSpec"]["template"]["spec"]["containers"]
            token = next(e for e in head["env"] if e["name"] == "STAGEMESH_INTERNAL_TOKEN")
            assert token["valueFrom"]["secretKeyRef"]["name"] == "stagemesh-internal-token"


def _probe_port(container: dict, probe: dict) -> int:
    port = next(iter(probe.values()))["port"]
    if isinstance(port, int):
        return port
    return next(p["containerPort"] for p in container["ports"] if p["name"] == port)


@pytest.mark.parametrize("name", ["stagemesh.yaml", "stagemesh.cuda.yaml"])
def test_the_mp_layout_fits_together(name):
    path = KUBE_DIR / "mp" / name
    workloads = {d["metadata"]["name"]: d for d in docs(path) if d["kind"] in ("Deployment", "StatefulSet")}
    services = {d["metadata"]["name"]: d for d in by_kind(path, "Service")}
    (sched_c,) = stagemesh_containers(workloads["stagemesh-scheduler"])
    (stage_c,) = stagemesh_containers(workloads["stagemesh-stage"])
    (router_c,) = stagemesh_containers(workloads["stagemesh-router"])
    sched, stage, router = (parse([expand(a, c) for a in c["args"]]) for c in (sched_c, stage_c, router_c))
    stages = workloads["stagemesh-stage"]
    # pod i is stage i of a split into as many stages as there are pods, as the scheduler expects
    assert stages["spec"]["replicas"] == stage.pipeline_parallel_size == sched.pipeline_parallel_size
    assert stage.layers is None and "$(STAGE_INDEX)" in stage_c["args"]
    index = next(e for e in stage_c["env"] if e["name"] == "STAGE_INDEX")["valueFrom"]["fieldRef"]["fieldPath"]
    assert index == "metadata.labels['apps.kubernetes.io/pod-index']"
    assert stages["spec"]["serviceName"] in services
    # the stages and the router reach the scheduler through its Service, on its ports
    ports = {p["port"] for p in services["stagemesh-scheduler"]["spec"]["ports"]}
    assert stage.scheduler == router.replica[0] == f"stagemesh-scheduler:{sched.port}" and sched.port in ports
    assert sched.advertise_host == "stagemesh-scheduler" and sched.dist_port in ports
    assert stage.advertise_host == SAMPLE_ENV["POD_IP"]
    # the stages register through the scheduler's Service before it is ready, and reach it while it drains
    assert services["stagemesh-scheduler"]["spec"]["publishNotReadyAddresses"] is True
    # probes: gRPC health on the services' own ports, the router's /ready and /health on its HTTP port
    for container, port in ((sched_c, sched.port), (stage_c, stage.port), (router_c, router.port)):
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert _probe_port(container, container[probe]) == port, (container["name"], probe)
    for workload in workloads.values():  # every Service selects pods that exist
        labels = workload["spec"]["template"]["metadata"]["labels"]
        assert workload["spec"]["selector"]["matchLabels"].items() <= labels.items()
    for service in services.values():
        assert any(service["spec"]["selector"].items() <= w["spec"]["template"]["metadata"]["labels"].items()
                   for w in workloads.values()), service["metadata"]["name"]
    gpus = stage_c["resources"]["limits"].get("nvidia.com/gpu")
    assert (stage.device, gpus) == (("cuda", str(stage.tensor_parallel_size)) if "cuda" in name else ("cpu", None))


def _pinned_ray() -> str:
    text = (ROOT / "pyproject.toml").read_text()
    pins = set(re.findall(r'"ray==([\d.]+)"', text))
    assert len(pins) == 1, f"pyproject.toml pins Ray once (the extra and dev): {pins}"
    return pins.pop()


@pytest.mark.parametrize("name", ["raycluster.yaml", "raycluster.cuda.yaml"])
def test_the_kuberay_layout_fits_together(name):
    (cluster,) = by_kind(KUBE_DIR / "kuberay" / name, "RayCluster")
    (service,) = by_kind(KUBE_DIR / "kuberay" / name, "Service")
    assert cluster["spec"]["rayVersion"] == _pinned_ray()
    assert cluster["metadata"]["annotations"]["ray.io/overwrite-container-cmd"] == "true"
    head_group = cluster["spec"]["headGroupSpec"]
    (head,) = head_group["template"]["spec"]["containers"]
    serve = parse(serve_command(head))
    assert "$KUBERAY_GEN_RAY_START_CMD" in head["args"][0]
    assert head_group["rayStartParams"]["num-cpus"] == "0"  # the stages go to the workers
    # each stage's bundle (TP ranks x threads CPUs, TP GPUs) fits one worker, and the workers hold them all
    (group,) = cluster["spec"]["workerGroupSpecs"]
    (worker,) = group["template"]["spec"]["containers"]
    assert "$KUBERAY_GEN_RAY_START_CMD" in worker["args"][0]
    tp, pp = serve.tensor_parallel_size, serve.pipeline_parallel_size
    cpus = int(group["rayStartParams"]["num-cpus"])
    gpus = int(group["rayStartParams"].get("num-gpus", worker["resources"]["limits"].get("nvidia.com/gpu", 0)))
    per_stage_cpus = tp * (serve.threads or 1)
    per_stage_gpus = tp if serve.device == "cuda" else 0
    assert cpus >= per_stage_cpus and gpus >= per_stage_gpus
    stages_per_worker = min(cpus // per_stage_cpus, gpus // per_stage_gpus if per_stage_gpus else pp)
    assert group["minReplicas"] * stages_per_worker >= pp
    assert worker["resources"]["limits"].get("nvidia.com/gpu", "0") == str(gpus)
    # the Service reaches the router on the head pod
    assert service["spec"]["selector"] == {"ray.io/cluster": cluster["metadata"]["name"], "ray.io/node-type": "head"}
    ports = {p["name"]: p["containerPort"] for p in head["ports"]}
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= ports.keys()
    assert ports["http"] == serve.port and ports["grpc"] == serve.grpc_port
    assert head["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert head["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}


def _pre_stop_s(container: dict) -> int:
    return container.get("lifecycle", {}).get("preStop", {}).get("sleep", {}).get("seconds", 0)


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: str(p.relative_to(KUBE_DIR)))
def test_probes_split_readiness_from_liveness_and_the_grace_period_covers_the_drain(path):
    """Readiness: the router's /ready, the gRPC services' grpc.health.v1 "" (unready pods get no traffic);
    liveness: /health and "liveness" (a service whose peers are away is not restarted). Kubernetes kills a
    pod terminationGracePeriodSeconds after its deletion, preStop included: that must cover the preStop
    sleep, the drain (--shutdown-timeout, given explicitly) and the time to exit."""
    checked = 0
    for doc in docs(path):
        for template in pod_templates(doc):
            grace = template["spec"].get("terminationGracePeriodSeconds", 30)  # Kubernetes' default
            for c in template["spec"]["containers"]:
                if c["name"] == "ray-worker":  # Ray's raylet: the stages it hosts are serve's to stop
                    continue
                argv = serve_command(c) if c["name"] == "ray-head" else [expand(a, c) for a in c["args"]]
                args = parse(argv)
                assert "--shutdown-timeout" in argv, f"{c['name']}: the drain's length is not given"
                if argv[0] in ("router", "serve"):  # serve: the KubeRay head, whose router the Service reaches
                    assert c["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}, c["name"]
                    assert c["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}, c["name"]
                    # endpoints are removed while the router still accepts; then it closes its listener
                    assert _pre_stop_s(c) > 0, c["name"]
                else:
                    assert c["readinessProbe"]["grpc"].get("service", "") == "", c["name"]
                    assert c["livenessProbe"]["grpc"] == {"port": args.port, "service": LIVENESS}, c["name"]
                drain = args.shutdown_timeout
                if argv[0] == "serve":  # mp or Ray: the routers drain, then the rest, each group within its own
                    drain = 2 * drain + EXIT_SLACK_S  # --shutdown-timeout and slack (stagemesh.entry.local_mesh.drain)
                assert grace >= _pre_stop_s(c) + drain + EXIT_SLACK_S, (c["name"], grace, _pre_stop_s(c), drain)
                checked += 1
    assert checked == (3 if path.parent.name == "mp" else 1)


# -- the KubeRay commands, run as KubeRay runs them, in three network namespaces ------------------------

def kuberay_start_command(params: dict, head_address: str | None, host_address: str, temp: str) -> str:
    """KUBERAY_GEN_RAY_START_CMD as the operator generates it from rayStartParams (plus a temp dir per node:
    the namespaces share one file system, as pods do not)."""
    role = ["--head", "--port=6379"] if head_address is None else [f"--address={head_address}:6379"]
    flags = [f"--{k}={v}" for k, v in params.items()]
    return " ".join(["ray start", *role, *flags, "--block", f"--node-ip-address={host_address}",
                     "--disable-usage-stats", f"--temp-dir={temp}"])


@pytest.mark.slow
@pytest.mark.timeout(360)
def test_the_kuberay_commands_serve_and_stop_cleanly(default_model_dir, tmp_path):
    pytest.importorskip("ray", reason="Ray is not installed (the dev extras install it: make install)")
    (cluster,) = by_kind(KUBE_DIR / "kuberay" / "raycluster.yaml", "RayCluster")
    head_group, (group,) = cluster["spec"]["headGroupSpec"], cluster["spec"]["workerGroupSpecs"]
    (head_c,) = head_group["template"]["spec"]["containers"]
    (worker_c,) = group["template"]["spec"]["containers"]
    lan = NetnsLan(1 + group["replicas"], subnet="10.76.0", tag=f"k{os.getpid()}")
    try:
        lan.__enter__()
    except NetnsUnavailable as err:
        pytest.skip(f"cannot make network namespaces: {err}")
    temp = tempfile.mkdtemp(prefix="smkr", dir="/tmp")
    try:
        head, *workers = lan.hosts
        bin_dir = str(Path(sys.executable).parent)  # `ray` and `stagemesh` on PATH, as in the image
        env = dict(PATH=f"{bin_dir}:{os.environ['PATH']}", STAGEMESH_CACHE=str(default_model_dir.parents[1]),
                   PYTHONUNBUFFERED="1", RAY_USAGE_STATS_ENABLED="0")
        head_env = clean_env(**env, GLOO_SOCKET_IFNAME=head.ifname, KUBERAY_GEN_RAY_START_CMD=kuberay_start_command(
            head_group["rayStartParams"], None, head.address, f"{temp}/head"))
        head_proc = head.spawn([*head_c["command"], *head_c["args"]], head_env, tmp_path / "head.log")
        for i, w in enumerate(workers):
            w_env = clean_env(**env, GLOO_SOCKET_IFNAME=w.ifname, KUBERAY_GEN_RAY_START_CMD=kuberay_start_command(
                group["rayStartParams"], head.address, w.address, f"{temp}/w{i}"))
            w.spawn([*worker_c["command"], *worker_c["args"]], w_env, tmp_path / f"worker{i}.log")
        port = parse(serve_command(head_c)).port
        deadline = time.monotonic() + 240
        while head.http("GET", f"http://{head.address}:{port}/ready", timeout=5)[0] != 200:  # the readinessProbe
            assert head_proc.poll() is None and time.monotonic() < deadline, (tmp_path / "head.log").read_text()[-4000:]
            time.sleep(0.2)
        assert head.http("GET", f"http://{head.address}:{port}/health", timeout=5)[0] == 200  # the livenessProbe
        chat = {"model": DEFAULT_MODEL_NAME, "temperature": 0, "max_tokens": 16,
                "messages": [{"role": "user", "content": "What is the capital of France?"}]}
        status, body = head.http("POST", f"http://{head.address}:{port}/v1/chat/completions", chat, timeout=120)
        assert status == 200 and "Paris" in body["choices"][0]["message"]["content"], body
        log = (tmp_path / "head.log").read_text()
        placed = re.findall(r"^\s+node (\S+): stage\[0\.\d\]", log, re.M)
        assert sorted(placed) == sorted(w.address for w in workers), log[-4000:]  # one stage per worker pod
        stagemesh_pids = [p for p in head.pids() + [q for w in workers for q in w.pids()] if _is_service(p)]
        assert len(stagemesh_pids) == 4, "router, scheduler and two stages run"
        head_proc.send_signal(signal.SIGTERM)  # what Kubernetes sends the head container
        assert head_proc.wait(timeout=60) == 0, (tmp_path / "head.log").read_text()[-4000:]
        gone_by = time.monotonic() + 2  # every service is gone within 2 s of the head's exit (polled, not slept)
        while [p for p in stagemesh_pids if _is_service(p)] and time.monotonic() < gone_by:
            time.sleep(0.05)
        assert [p for p in stagemesh_pids if _is_service(p)] == [], "a service outlived the head pod's SIGTERM"
    finally:
        lan.__exit__()
        subprocess.run(["rm", "-rf", temp], timeout=60)


def _is_service(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
        with open(f"/proc/{pid}/stat") as f:
            if f.read().split()[2] == "Z":
                return False
    except OSError:
        return False
    return b"stagemesh" in argv and any(a in argv for a in (b"router", b"scheduler", b"stage"))
