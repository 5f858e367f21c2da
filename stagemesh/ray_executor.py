"""`stagemesh serve --distributed-executor-backend ray`: the mesh's services placed on a Ray cluster.

Ray is the placement, lifecycle and restart layer, not a wire: every service is a Ray actor
(stagemesh.ray_actor) that runs `stagemesh <service> ...` as its child on the node Ray chose, and the
services talk gRPC to each other exactly as they do under the mp backend. The router and the
schedulers run on this node (the head of the mesh, as vLLM's API server does; they ask for no CPUs);
each stage runs in a placement group of its own, one bundle holding its TP ranks' CPUs and GPUs (a
bundle never spans nodes: a stage's TP followers are its child processes, and CPU TP shares memory), so
Ray packs a stage's TP group on one node and spreads the stages over the nodes with room. A stage whose
node leaves the cluster is placed again by Ray on another node with room and rejoins its scheduler,
which kept its requests meanwhile (--stage-recovery-timeout).

Ray's own control plane serialises with pickle and runs what it is sent (its design, and vLLM's warning
about Ray clusters): the driver sends the actors only command lines and environment strings, and the
backend inherits Ray's trust model. Keep a Ray cluster's ports on a private network (docs/ray.md).
"""
from __future__ import annotations

import logging
import os
import socket
import sys
import time
import uuid
from dataclasses import dataclass, field

from stagemesh.core.errors import StagemeshError

log = logging.getLogger("stagemesh.serve")

PLACEMENT_TIMEOUT_S = 120.0  # waiting for Ray to find room for every stage before giving up with what is missing
FIRST_STATUS_TIMEOUT_S = 120.0  # an actor's first answer (Ray may start a worker process for it)
POLL_S = 1.0
STOP_TIMEOUT_S = 15.0
PROBE_TIMEOUT_S = 5.0


def _import_ray():
    # read when ray is imported: every line of every service reaches serve's log (Ray would fold identical
    # lines of different services into one), and colour codes only on a terminal
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    os.environ.setdefault("RAY_COLOR_PREFIX", "1" if sys.stderr.isatty() else "0")
    try:
        import ray
    except ImportError:
        raise StagemeshError("--distributed-executor-backend ray needs Ray on every node: "
                             "pip install 'stagemesh[ray]'") from None
    return ray


def cluster_address() -> str:
    """host:port of the cluster's GCS: RAY_ADDRESS, else the last `ray start` on this node (as `ray.init`
    finds it); StagemeshError when there is none or it does not answer (ray.init would wait for minutes)."""
    _import_ray()  # its message, before the address lookup needs Ray
    given = os.environ.get("RAY_ADDRESS", "")
    if given.startswith("ray://"):
        raise StagemeshError(f"RAY_ADDRESS={given}: a Ray Client address; run `stagemesh serve` on a node of the "
                             "cluster instead (the router and the schedulers run on the node serve runs on)")
    hint = ("start one with `ray start --head` on this node (and `ray start --address HEAD_IP:6379` on the others) "
            "or set RAY_ADDRESS")
    try:
        from ray._private.services import canonicalize_bootstrap_address_or_die

        address = canonicalize_bootstrap_address_or_die(given or "auto")
    except (ConnectionError, ValueError) as err:
        raise StagemeshError(f"--distributed-executor-backend ray: no Ray cluster found ({err}); {hint}") from None
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=PROBE_TIMEOUT_S).close()
    except (OSError, ValueError) as err:
        where = "RAY_ADDRESS" if given else "the last `ray start` on this node"
        raise StagemeshError(f"--distributed-executor-backend ray: no Ray cluster answers at {address} (from {where}: "
                             f"{err}); {hint}") from None
    return address


class _Stopped(Exception):
    """SIGTERM or SIGINT while serve waited for Ray."""


@dataclass
class Placed:
    """One service under its Ray actor, as the driver last saw it."""
    spec: object  # stagemesh.serve.ChildSpec
    actor: object
    group: object | None = None  # the stage's placement group
    status: dict = field(default_factory=dict)
    unavailable: bool = False


class RayCluster:
    def __init__(self, ray, address: str):
        self.ray, self.address = ray, address
        self.head_id = ray.get_runtime_context().get_node_id()
        nodes = {n["NodeID"]: n for n in ray.nodes() if n["Alive"]}
        self.head_ip = nodes[self.head_id]["NodeManagerAddress"]
        self.placed: list[Placed] = []
        self.stop: dict = {"signal": None}

    @classmethod
    def connect(cls) -> "RayCluster":
        ray = _import_ray()
        address = cluster_address()
        ray.init(address=address, namespace="stagemesh", logging_level=logging.WARNING, log_to_driver=True)
        cluster = cls(ray, address)
        log.info("connected to the Ray cluster at %s: %d node(s), %s; the router and the schedulers run on this "
                 "node (%s)", address, len(cluster.alive_nodes()), _resources(ray.cluster_resources()),
                 cluster.head_ip)
        return cluster

    def alive_nodes(self) -> list[dict]:
        return [n for n in self.ray.nodes() if n["Alive"]]

    def has_gpus(self) -> bool:
        return self.ray.cluster_resources().get("GPU", 0) > 0

    # -- start ----------------------------------------------------------------------------------------
    def serve(self, specs: list, env: dict[str, str], stop: dict, policy: str, metrics) -> int:
        self.stop = stop
        try:
            self.wait_for_room(specs)
            groups = self.place_stages([s for s in specs if s.kind == "stage"])
        except _Stopped:
            return 0
        for spec in specs:
            self.placed.append(self.start(spec, env, policy, groups.get(spec.name)))
        self.first_statuses()
        log.info("placement:\n%s", self.describe())
        return self.supervise(stop, metrics)

    def wait_for_room(self, specs: list) -> None:
        """Until the cluster's nodes could hold every stage (nodes may still be joining: KubeRay starts the
        head's pod and the workers' side by side); StagemeshError with what is missing after the timeout."""
        deadline = time.monotonic() + PLACEMENT_TIMEOUT_S
        while (missing := self.missing_room([s for s in specs if s.kind == "stage"])) is not None:
            self._raise_if_stopped()
            if time.monotonic() >= deadline:
                raise StagemeshError(f"{missing} (waited {PLACEMENT_TIMEOUT_S:.0f}s for nodes to join)")
            log.info("waiting for Ray nodes to join: %s", missing)
            time.sleep(5)

    def _raise_if_stopped(self) -> None:
        if self.stop["signal"]:
            log.info("signal %d: stopping before the mesh started", self.stop["signal"])
            raise _Stopped

    def missing_room(self, stages: list) -> str | None:
        """Why the alive nodes cannot hold the stages, or None when they can."""
        nodes = self.alive_nodes()
        biggest = max(nodes, key=lambda n: (n["Resources"].get("GPU", 0), n["Resources"].get("CPU", 0)))
        for spec in stages:
            if not any(_fits(_bundle(spec), n["Resources"]) for n in nodes):
                return (f"{spec.name} needs {_resources(_bundle(spec))} on one node; no node of the Ray cluster has "
                        f"that much (the largest: {_resources(biggest['Resources'])}). Use a smaller -tp or "
                        "--threads, or add a bigger node")
        need = {k: sum(_bundle(s).get(k, 0) for s in stages) for k in ("CPU", "GPU")}
        total = self.ray.cluster_resources()
        if not _fits(need, total):
            return (f"the stages need {_resources(need)} in all; the Ray cluster has {_resources(total)}. Add "
                    "nodes, or use smaller -tp / -pp / -dp / --threads")
        return None

    def place_stages(self, stages: list) -> dict:
        """A placement group per stage, ready; StagemeshError naming what Ray could not place in time."""
        from ray.util.placement_group import placement_group, remove_placement_group

        mesh = uuid.uuid4().hex[:8]
        groups = {s.name: placement_group([_bundle(s)], strategy="STRICT_PACK", name=f"stagemesh-{mesh}-{s.name}")
                  for s in stages}
        waiting = {g.ready(): name for name, g in groups.items()}
        deadline = time.monotonic() + PLACEMENT_TIMEOUT_S
        while waiting and time.monotonic() < deadline and not self.stop["signal"]:
            done, _ = self.ray.wait(list(waiting), num_returns=len(waiting), timeout=5)
            for ref in done:
                waiting.pop(ref)
            if waiting:
                log.info("waiting for Ray to find room for %s", ", ".join(sorted(waiting.values())))
        if waiting:
            for group in groups.values():
                remove_placement_group(group)
            self._raise_if_stopped()
            available = _resources(self.ray.available_resources())
            raise StagemeshError(f"Ray found no room for {', '.join(sorted(waiting.values()))} within "
                                 f"{PLACEMENT_TIMEOUT_S:.0f}s (available: {available})")
        return groups

    def start(self, spec, env: dict[str, str], policy: str, group) -> Placed:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

        from stagemesh.ray_actor import ServiceActor

        options = dict(max_restarts=-1 if policy == "on-failure" else 0, max_task_retries=0, max_concurrency=2,
                       num_cpus=spec.cpus, num_gpus=spec.gpus)
        if group is None:  # the router and the schedulers: on this node
            options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(self.head_id, soft=False)
        else:
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=0)
        actor = self.ray.remote(ServiceActor).options(**options).remote(spec.name, spec.argv, {**spec.env, **env},
                                                                         policy)
        return Placed(spec, actor, group)

    def first_statuses(self) -> None:
        from stagemesh import __version__

        refs = [p.actor.status.remote() for p in self.placed]
        try:
            statuses = self.ray.get(refs, timeout=FIRST_STATUS_TIMEOUT_S)
        except self.ray.exceptions.GetTimeoutError:
            raise StagemeshError(f"the services' Ray actors did not start within {FIRST_STATUS_TIMEOUT_S:.0f}s") \
                from None
        for placed, status in zip(self.placed, statuses):
            placed.status = status
            if status["version"] != __version__:
                raise StagemeshError(f"{placed.spec.name} on node {status['node_ip']} runs stagemesh "
                                     f"{status['version']}; this node runs {__version__}: install the same version "
                                     "on every node")

    def describe(self) -> str:
        """Which node runs what: one line per node."""
        by_node: dict[str, list[str]] = {}
        for p in self.placed:
            extra = f" ({_resources(_bundle(p.spec))})" if p.spec.kind == "stage" else ""
            by_node.setdefault(p.status.get("node_ip", "?"), []).append(p.spec.name + extra)
        return "\n".join(f"  node {ip}{' (this node)' if ip == self.head_ip else ''}: {', '.join(names)}"
                         for ip, names in sorted(by_node.items()))

    # -- run ------------------------------------------------------------------------------------------
    def supervise(self, stop: dict, metrics) -> int:
        up, restarts = metrics
        while stop["signal"] is None:
            for placed in self.placed:
                reason = self.look(placed, restarts)
                if reason:
                    log.error("%s", reason)
                    return 1
                up.labels(placed.spec.name).set(0 if placed.unavailable or not placed.status.get("pid") else 1)
            time.sleep(POLL_S)
        log.info("signal %d: stopping every service", stop["signal"])
        return 0

    def look(self, placed: Placed, restarts) -> str | None:
        """Read one actor's status; log what changed. Returns why the mesh must stop, if it must."""
        ray, name = self.ray, placed.spec.name
        try:
            status = ray.get(placed.actor.status.remote(), timeout=10)
        except ray.exceptions.ActorDiedError as err:
            return f"{name}'s Ray actor died and will not be restarted: {str(err).splitlines()[0]}; stopping the mesh"
        except (ray.exceptions.ActorUnavailableError, ray.exceptions.GetTimeoutError, ray.exceptions.RayActorError):
            if not placed.unavailable:
                log.warning("%s (node %s) does not answer: Ray is restarting it, or placing it again if its node "
                            "left the cluster", name, placed.status.get("node_ip", "?"))
            placed.unavailable = True
            return None
        before, placed.status, placed.unavailable = placed.status, status, False
        if status["actor_pid"] != before.get("actor_pid") or status["node_id"] != before.get("node_id"):
            moved = status["node_ip"] != before.get("node_ip")
            log.warning("%s restarted by Ray on node %s%s", name, status["node_ip"],
                        f" (it ran on {before.get('node_ip')})" if moved else "")
            restarts.labels(name).inc()
        elif status["restarts"] > before.get("restarts", 0):
            restarts.labels(name).inc(status["restarts"] - before.get("restarts", 0))
        return f"{name} on node {status['node_ip']}: {status['stopped']}" if status["stopped"] else None

    # -- stop -----------------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop every service (SIGTERM to each, the router first), then its actor and placement group."""
        from ray.util.placement_group import remove_placement_group

        ray = self.ray
        refs = [p.actor.stop.remote(STOP_TIMEOUT_S - 2) for p in reversed(self.placed)]
        try:
            ray.wait(refs, num_returns=len(refs), timeout=STOP_TIMEOUT_S)
        except Exception:  # an actor that is gone already has nothing left to stop
            pass
        for placed in self.placed:
            ray.kill(placed.actor, no_restart=True)
            if placed.group is not None:
                remove_placement_group(placed.group)
        self.placed.clear()
        ray.shutdown()


def _bundle(spec) -> dict[str, float]:
    bundle = {"CPU": float(spec.cpus)}
    if spec.gpus:
        bundle["GPU"] = float(spec.gpus)
    return bundle


def _fits(need: dict, have: dict) -> bool:
    return all(have.get(k, 0) >= v for k, v in need.items() if v)


def _resources(resources: dict) -> str:
    shown = {k: v for k, v in resources.items() if k in ("CPU", "GPU")}
    return ", ".join(f"{k} {v:g}" for k, v in sorted(shown.items())) or "no CPU or GPU"
