"""`stagemesh serve --distributed-executor-backend ray`: the mesh's services placed on a Ray cluster.

Ray is the placement, lifecycle and restart layer, not a wire: every service is a Ray actor
(stagemesh.entry.ray_actor) that runs `stagemesh <service> ...` as its child on the node Ray chose, and the
services talk gRPC to each other exactly as they do under the mp backend. The router and the
schedulers run on this node (the head of the mesh, as vLLM's API server does; they ask for no CPUs);
each stage runs in a placement group of its own, one bundle holding its TP ranks' CPUs and GPUs (a
bundle never spans nodes: a stage's TP followers are its child processes, and CPU TP shares memory), so
Ray packs a stage's TP group on one node and spreads the stages over the nodes with room. A stage whose
node leaves the cluster is placed again by Ray on another node with room and rejoins its scheduler,
which kept its requests meanwhile (--stage-recovery-timeout). Replicas that serve's operations add or remove
while the mesh serves (stagemesh.entry.ray_mesh) are placed and let go the same way (RayCluster.add, remove).

Ray's own control plane serialises with pickle and runs what it is sent (its design, and vLLM's warning
about Ray clusters): the driver sends the actors only command lines, environment strings and numbers, and the
backend inherits Ray's trust model. Keep a Ray cluster's ports on a private network (docs/ray.md).
"""
from __future__ import annotations

import logging
import os
import socket
import sys
import threading
import time
import uuid
from typing import Callable

from stagemesh.core.errors import StagemeshError
from stagemesh.entry import ray_room as room
from stagemesh.entry.ray_service import RayService

log = logging.getLogger("stagemesh.serve")

PLACEMENT_TIMEOUT_S = 120.0  # waiting for Ray to find room for every stage before giving up with what is missing
FIRST_STATUS_TIMEOUT_S = 120.0  # an actor's first answer (Ray may start a worker process for it)
POLL_S = 1.0
STOP_TIMEOUT_S = 15.0
PROBE_TIMEOUT_S = 5.0
# a Ray GCS answers one call in milliseconds; ray.init at an address that is not one retries for ever, deaf to
# SIGTERM, so serve asks first, and gives up after this long
GCS_ANSWER_TIMEOUT_S = 10.0


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


class Stopped(Exception):
    """SIGTERM or SIGINT while serve waited for Ray."""


def check_gcs(address: str, stopping: Callable[[], bool]) -> None:
    """That `address` answers as a Ray cluster's GCS (one GetClusterId call, Ray's own protobuf messages) within
    GCS_ANSWER_TIMEOUT_S: StagemeshError when it does not, Stopped when serve is told to stop meanwhile."""
    import grpc
    from ray._private.grpc_utils import init_grpc_channel  # Ray's own channel: RAY_USE_TLS, token auth
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

    given = os.environ.get("RAY_ADDRESS")
    where = "RAY_ADDRESS" if given else "the last `ray start` on this node"
    channel = init_grpc_channel(address)
    try:  # (Ray's generated gcs_service_pb2 makes its message classes at run time: mypy sees none of them)
        call = gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel).GetClusterId.future(
            gcs_service_pb2.GetClusterIdRequest(), timeout=GCS_ANSWER_TIMEOUT_S, wait_for_ready=True)  # type: ignore[attr-defined]
        while not call.done():
            if stopping():
                call.cancel()
                log.info("serve was told to stop while connecting to Ray")
                raise Stopped
            time.sleep(0.1)
        try:
            call.result()
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.UNAUTHENTICATED:  # a GCS that wants a token ray.init may find itself
                return
            raise StagemeshError(
                f"--distributed-executor-backend ray: {address} (from {where}) does not answer as a Ray cluster's GCS "
                f"within {GCS_ANSWER_TIMEOUT_S:.0f}s ({err.code().name}: {err.details()}); give RAY_ADDRESS the "
                "head node's GCS address (HOST:6379 by default, as `ray start --head` prints it)") from None
    finally:
        channel.close()


class RayCluster:
    """Where the mesh's services run: the placement groups and actors of the services serve placed."""

    def __init__(self, ray, address: str):
        self.ray, self.address = ray, address
        self.head_id = ray.get_runtime_context().get_node_id()
        nodes = {n["NodeID"]: n for n in ray.nodes() if n["Alive"]}
        self.head_ip = nodes[self.head_id]["NodeManagerAddress"]
        self.placed: list[RayService] = []
        self.lock = threading.Lock()  # self.placed changes while serve's supervision reads it
        self.stopping: Callable[[], bool] = lambda: False  # serve was told to stop

    @classmethod
    def connect(cls, stopping: Callable[[], bool] = lambda: False) -> "RayCluster":
        """The cluster, once its GCS answered (check_gcs); stopping: serve was told to stop (Stopped)."""
        ray = _import_ray()
        address = cluster_address()
        log.info("connecting to the Ray cluster at %s", address)
        check_gcs(address, stopping)
        ray.init(address=address, namespace="stagemesh", logging_level=logging.WARNING, log_to_driver=True)
        cluster = cls(ray, address)
        log.info("connected to the Ray cluster at %s: %d node(s), %s; the router and the schedulers run on this "
                 "node (%s)", address, len(cluster.alive_nodes()), room.resources(ray.cluster_resources()),
                 cluster.head_ip)
        return cluster

    def alive_nodes(self) -> list[dict]:
        return [n for n in self.ray.nodes() if n["Alive"]]

    def has_gpus(self) -> bool:
        return self.ray.cluster_resources().get("GPU", 0) > 0

    def services(self) -> list[RayService]:
        with self.lock:
            return list(self.placed)

    # -- start ----------------------------------------------------------------------------------------
    def start_mesh(self, services: list[RayService], policy: str) -> None:
        """Place and start every service once the cluster has room; Stopped on a signal meanwhile."""
        self.wait_for_room([s.spec for s in services])
        self.add(services, policy)

    def add(self, services: list[RayService], policy: str) -> None:
        """Place the stages' groups, start every service's actor and read its first status."""
        groups = self.place_stages([s.spec for s in services if s.kind == "stage"])
        for service in services:
            self.start(service, policy, groups.get(service.name))
        with self.lock:
            self.placed += services
        self.first_statuses(services)
        log.info("placement:\n%s", self.describe(services))

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
        if self.stopping():
            log.info("serve was told to stop: placing nothing more")
            raise Stopped

    def missing_room(self, stages: list) -> str | None:
        """Why the alive nodes could never hold the stages, or None when they could."""
        nodes = [n["Resources"] for n in self.alive_nodes()]
        return room.missing_room(nodes, self.ray.cluster_resources(), stages)

    def missing_free_room(self, stages: list) -> str | None:
        """Why the nodes' free resources cannot hold these stages now (a replica added), or None."""
        from ray._private.state import available_resources_per_node  # (a developer API: there is no public one)

        ips = {n["NodeID"]: n["NodeManagerAddress"] for n in self.alive_nodes()}
        free = {ips[node]: have for node, have in available_resources_per_node().items() if node in ips}
        return room.missing_free_room(free, stages)

    def place_stages(self, stages: list) -> dict:
        """A placement group per stage, ready; StagemeshError naming what Ray could not place in time."""
        from ray.util.placement_group import placement_group, remove_placement_group

        mesh = uuid.uuid4().hex[:8]
        groups = {s.name: placement_group([room.bundle(s)], strategy="STRICT_PACK", name=f"stagemesh-{mesh}-{s.name}")
                  for s in stages}
        waiting = {g.ready(): name for name, g in groups.items()}
        deadline = time.monotonic() + PLACEMENT_TIMEOUT_S
        while waiting and time.monotonic() < deadline and not self.stopping():
            done, _ = self.ray.wait(list(waiting), num_returns=len(waiting), timeout=5)
            for ref in done:
                waiting.pop(ref)
            if waiting:
                log.info("waiting for Ray to find room for %s", ", ".join(sorted(waiting.values())))
        if waiting:
            for group in groups.values():
                remove_placement_group(group)
            self._raise_if_stopped()
            available = room.resources(self.ray.available_resources())
            raise StagemeshError(f"Ray found no room for {', '.join(sorted(waiting.values()))} within "
                                 f"{PLACEMENT_TIMEOUT_S:.0f}s (available: {available})")
        return groups

    def start(self, service: RayService, policy: str, group) -> None:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

        from stagemesh.entry.ray_actor import ServiceActor

        spec = service.spec
        options: dict[str, object]  # (the scheduling strategy too)
        options = dict(max_restarts=-1 if policy == "on-failure" else 0, max_task_retries=0, max_concurrency=4,
                       num_cpus=spec.cpus, num_gpus=spec.gpus)
        if group is None:  # the router and the schedulers: on this node
            options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(self.head_id, soft=False)
        else:
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=0)
        service.actor = self.ray.remote(ServiceActor).options(**options).remote(spec.name, service.argv,
                                                                                service.env, policy)
        service.group = group

    def first_statuses(self, services: list[RayService]) -> None:
        from stagemesh import __version__

        refs = [s.actor.status.remote() for s in services]
        try:
            statuses = self.ray.get(refs, timeout=FIRST_STATUS_TIMEOUT_S)
        except self.ray.exceptions.GetTimeoutError:
            raise StagemeshError(f"the services' Ray actors did not start within {FIRST_STATUS_TIMEOUT_S:.0f}s") \
                from None
        for service, status in zip(services, statuses):
            service.status = status
            if status["version"] != __version__:
                raise StagemeshError(f"{service.name} on node {status['node_ip']} runs stagemesh "
                                     f"{status['version']}; this node runs {__version__}: install the same version "
                                     "on every node")

    def describe(self, services: list[RayService]) -> str:
        """Which node runs what: one line per node."""
        by_node: dict[str, list[str]] = {}
        for s in services:
            extra = f" ({room.resources(room.bundle(s.spec))})" if s.kind == "stage" else ""
            by_node.setdefault(s.status.get("node_ip", "?"), []).append(s.name + extra)
        return "\n".join(f"  node {ip}{' (this node)' if ip == self.head_ip else ''}: {', '.join(names)}"
                         for ip, names in sorted(by_node.items()))

    # -- stop -----------------------------------------------------------------------------------------
    def remove(self, services: list[RayService]) -> None:
        """Forget the services (stopped already): their actors and placement groups go."""
        with self.lock:
            self.placed = [s for s in self.placed if s not in services]
        self._release(services)

    def _release(self, services: list[RayService]) -> None:
        from ray.util.placement_group import remove_placement_group

        for service in services:
            service.removed = True
            if service.actor is not None:
                self.ray.kill(service.actor, no_restart=True)
            if service.group is not None:
                remove_placement_group(service.group)

    def shutdown(self) -> None:
        """Stop what still runs (SIGTERM, SIGKILL after STOP_TIMEOUT_S - 2: serve drained them already, unless
        it failed), then every actor and placement group."""
        services = self.services()
        refs = [s.actor.stop.remote(STOP_TIMEOUT_S - 2) for s in reversed(services) if s.actor is not None]
        try:
            self.ray.wait(refs, num_returns=len(refs), timeout=STOP_TIMEOUT_S)
        except Exception:  # an actor that is gone already has nothing left to stop
            pass
        self.remove(services)
        self.ray.shutdown()
