"""serve's mesh on a Ray cluster (`--distributed-executor-backend ray`): the host serve's operations run on
(stagemesh.entry.ops.mesh.MeshHost: a rolling restart, scaling, the autoscaler work as on the mp backend), serve's
supervision of the services' actors, and its drain front to back.

A service is a stagemesh.entry.ray_service.RayService: its actor (stagemesh.entry.ray_actor.ServiceActor) supervises its
child process, and an operation holds it there (no restart meanwhile), SIGTERMs it (it drains), waits for its
exit and starts it again. A replica added at run time gets a scheduler actor on this node and a placement group
per stage, as the first ones did (stagemesh.entry.ray_executor.RayCluster.add); one removed loses its actors and
placement groups once its scheduler drained and its stages stopped. Told to stop, serve drains the routers, then
the schedulers and stages (each group within --shutdown-timeout and a little more, as mp), then lets the
actors and placement groups go."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable, cast

from stagemesh.core.errors import StagemeshError
from stagemesh.entry.layout import ChildSpec, MeshLayout
from stagemesh.entry.local_mesh import Signals, drain
from stagemesh.entry.ops.mesh import ServeMesh, assemble
from stagemesh.entry.ray_executor import RayCluster, Stopped
from stagemesh.entry.ray_room import bundle, resources
from stagemesh.entry.ray_service import RayService
from stagemesh.entry.supervisor import EXIT_REFUSED

log = logging.getLogger("stagemesh.serve")
POLL_S = 1.0


@dataclass(eq=False)
class RayHost:
    cluster: RayCluster
    policy: str  # --restart-policy
    shutdown_timeout_s: float
    metrics: tuple  # (up gauge, restarts counter)
    signals: Signals
    env: dict[str, str]  # what every actor adds to its environment (the internal token)
    services: list[RayService] = field(default_factory=list)  # those serve starts with
    before_drain: list[Callable[[], None]] = field(default_factory=list)
    backend: str = "ray"

    @property
    def stopping(self) -> bool:
        return self.signals.count > 0

    # -- stagemesh.entry.ops.mesh.MeshHost ----------------------------------------------------------------------
    def make(self, spec: ChildSpec) -> RayService:
        return RayService(spec, {**spec.env, **self.env})

    def hold(self, services: list[RayService], held: bool) -> None:
        for service in services:
            if not service.hold(held):
                log.warning("%s's actor did not answer: its supervisor may %s it", service.name,
                            "restart" if held else "not restart")

    def start(self, service: RayService) -> bool:
        if self.stopping:
            return False
        if not service.start_again():
            raise StagemeshError(f"{service.name}'s Ray actor did not start it again (the actor is gone, or the "
                                 "service still runs)")
        return True

    def add(self, services: list[RayService]) -> bool:
        if self.stopping:
            return False
        try:
            self.cluster.add(services, self.policy)
        except Stopped:
            self.cluster.remove(services)
            return False
        except StagemeshError:
            self.cluster.remove(services)
            raise
        return True

    def remove(self, services: list[RayService]) -> None:
        self.cluster.remove(services)

    def missing_room(self, replicas: int, now: int, stages: list[ChildSpec]) -> str | None:
        """Why the cluster's free resources cannot hold the stages of the replicas to add, or None."""
        if replicas <= now:
            return None
        why = self.cluster.missing_free_room([s for _ in range(replicas - now) for s in stages])
        if why is None:
            return None
        each = ", ".join(resources(bundle(s)) for s in stages)
        return f"a replica's stages need {each} (each on one node); {why}"

    # -- serve ----------------------------------------------------------------------------------------
    def run(self) -> int:
        """Place and start every service, supervise them until a signal (then drain) or a death the policy will
        not mend."""
        self.cluster.stopping = lambda: self.stopping
        try:
            self.cluster.start_mesh(self.services, self.policy)
        except Stopped:
            return 0
        code = self.supervise()
        for hook in self.before_drain:
            hook()
        if self.stopping:
            drain(self.cluster.services(), self.shutdown_timeout_s, self.signals)
        return code

    def supervise(self) -> int:
        up, restarts = self.metrics
        while not self.stopping:
            for service in self.cluster.services():
                reason = service.look(restarts)
                if reason:
                    log.error("%s", reason)
                    return EXIT_REFUSED if service.status.get("refused") else 1
                up.labels(service.name).set(0 if service.unavailable or not service.status.get("pid") else 1)
            time.sleep(POLL_S)
        return 0


def build(args, layout: MeshLayout, cluster: RayCluster, env: dict[str, str], signals: Signals, metrics,
          token: str) -> ServeMesh:
    """The mesh serve places on the cluster (started by mesh.host.run())."""
    host = RayHost(cluster, args.restart_policy, args.shutdown_timeout, metrics, signals, env)
    mesh = assemble(host, layout, token)
    host.services = cast(list[RayService],  # (host.make made every one)
                         [*(c for g in mesh.replicas for c in g.children), *(r.child for r in mesh.routers)])
    return mesh
