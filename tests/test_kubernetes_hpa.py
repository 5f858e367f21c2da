"""deploy/kubernetes/hpa: the HorizontalPodAutoscaler example validates against the pinned Kubernetes (strict),
scales the Deployment of `stagemesh serve` pods in the same file on the vllm: metric the routers export, with
hysteresis, and each pod it removes drains within its grace period (tests/test_kubernetes.py validates every
manifest and parses every command too)."""
from __future__ import annotations

import pytest

from test_kubernetes import KUBE_DIR, KUBERNETES_VERSION, by_kind, docs, parse

HPA_FILE = KUBE_DIR / "hpa" / "stagemesh-serve-hpa.yaml"


def test_the_hpa_example_validates_strictly():
    import kubernetes_validate

    kinds = [d["kind"] for d in docs(HPA_FILE)]
    assert kinds == ["Deployment", "Service", "HorizontalPodAutoscaler"]
    for doc in docs(HPA_FILE):
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    (hpa,) = by_kind(HPA_FILE, "HorizontalPodAutoscaler")
    hpa["spec"]["behavior"]["scaleDown"]["stabilizationWindow"] = 300  # a typo the schema refuses
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(hpa, KUBERNETES_VERSION, strict=True)


def test_the_hpa_scales_the_serve_pods_on_the_routers_waiting_requests_with_hysteresis():
    from router import metrics

    (deployment,) = by_kind(HPA_FILE, "Deployment")
    (hpa,) = by_kind(HPA_FILE, "HorizontalPodAutoscaler")
    (service,) = by_kind(HPA_FILE, "Service")
    spec = hpa["spec"]
    assert spec["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                      "name": deployment["metadata"]["name"]}
    assert 1 <= spec["minReplicas"] < spec["maxReplicas"]
    (metric,) = spec["metrics"]
    name = metric["pods"]["metric"]["name"]
    exported = {m.describe()[0].name for m in (metrics.WAITING, metrics.RUNNING, metrics.KV_USAGE)}
    assert name.replace("vllm_", "vllm:", 1) in exported  # the adapter's rule drops the colon
    behavior = spec["behavior"]
    assert behavior["scaleDown"]["stabilizationWindowSeconds"] > behavior["scaleUp"]["stabilizationWindowSeconds"]
    # each pod is a whole mesh: serve, its router on the port Prometheus scrapes and the Service targets
    template = deployment["spec"]["template"]
    (container,) = template["spec"]["containers"]
    args = parse(container["args"])
    assert args.command == "serve" and args.host == "0.0.0.0"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["http"] == args.port == int(template["metadata"]["annotations"]["prometheus.io/port"])
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= ports.keys()
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"  # unready while it drains
    # a removed pod drains (routers, then the rest: tests/test_kubernetes.py checks the grace period covers both)
    # before the kubelet's SIGKILL, and a rolling update surges first
    assert template["spec"]["terminationGracePeriodSeconds"] > 2 * args.shutdown_timeout
    assert deployment["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
