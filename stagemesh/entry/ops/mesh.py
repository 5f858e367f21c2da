"""The serve mesh as its operations see it: the replicas (each a scheduler and its stages, by index), the routers
(each with its control port), and what every router is to balance over. The operations are written against two
small interfaces, so that one rollout and one scaling serve both backends: a Service (one service of the mesh: a
local child process, stagemesh.entry.supervisor.Child, or one under a Ray actor,
stagemesh.entry.ray_service.RayService) and a MeshHost (what runs them: stagemesh.entry.local_mesh.LocalMesh, or
stagemesh.entry.ray_mesh.RayHost)."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, Protocol, cast

from stagemesh.entry.layout import ChildSpec, MeshLayout
from stagemesh.entry.local_mesh import LocalMesh
from stagemesh.entry.ops.rpc import MeshRPC
from stagemesh.entry.supervisor import Child

log = logging.getLogger("stagemesh.serve")


class Service(Protocol):
    """One service of the mesh, as an operation drives it."""
    argv: list[str]

    @property
    def name(self) -> str: ...  # (read-only: a Ray service's comes from its spec)

    @property
    def kind(self) -> str: ...  # router, scheduler or stage

    @property
    def pid(self) -> int: ...  # the running process's; 0 when none runs

    @property
    def alive(self) -> bool: ...

    @property
    def exit_code(self) -> int | None: ...

    def terminate_once(self) -> None: ...  # SIGTERM (it drains), unless it had it already
    def kill(self) -> None: ...  # SIGKILL and reap
    def set_argv(self, argv: list[str]) -> None: ...  # the command line it starts with from now on
    def describe(self) -> dict: ...


class MeshHost(Protocol):
    """What runs the services and restarts those that die, unless an operation holds them."""
    backend: str  # mp or ray
    shutdown_timeout_s: float  # --shutdown-timeout: a service's drain
    before_drain: list[Callable[[], None]]  # run when serve was told to stop, before its drain

    def make(self, spec: ChildSpec) -> Service: ...  # a service planned, not started
    def hold(self, services: list, held: bool) -> None: ...  # its supervisor leaves it alone (or no more)
    def start(self, service) -> bool: ...  # start a held service again; False once serve stops
    def add(self, services: list) -> bool: ...  # place and start new services; False once serve stops
    def remove(self, services: list) -> None: ...  # forget stopped services
    def missing_room(self, replicas: int, now: int, stages: list[ChildSpec]) -> str | None: ...


@dataclass
class ReplicaGroup:
    index: int
    address: str  # its scheduler's host:port
    scheduler: Service
    stages: list[Service]
    joined: bool = True  # the routers know it (a replica being added joins once it is ready)
    cordoned: bool = False  # the routers send it no new request (it is being removed)

    @property
    def children(self) -> list[Service]:
        return [self.scheduler, *self.stages]

    @property
    def name(self) -> str:
        return f"replica {self.index} ({self.address})"


@dataclass
class RouterChild:
    child: Service
    control: str  # its control port, host:port (router.control)


@dataclass
class ServeMesh:
    host: MeshHost
    layout: MeshLayout
    replicas: list[ReplicaGroup]
    routers: list[RouterChild]
    rpc: MeshRPC
    version: int = 0  # of what the routers are to balance over: one more at each change
    acked: dict[str, tuple[int, int]] = field(default_factory=dict)  # router -> (its pid, the version it took)

    @property
    def shutdown_timeout_s(self) -> float:
        return self.host.shutdown_timeout_s

    @property
    def args(self):
        return self.layout.args

    def wanted(self) -> dict[str, bool]:
        """What every router is to balance over: joined replicas -> cordoned."""
        return {g.address: g.cordoned for g in self.replicas if g.joined}

    def changed(self) -> None:
        """The replicas changed: a router started from now on gets them on its command line, and the running
        ones are told (ops.steps.sync_routers)."""
        self.version += 1
        specs = self.layout.routers(list(self.wanted()))
        for router, spec in zip(self.routers, specs):
            router.child.set_argv(spec.argv)

    def new_replica(self) -> ReplicaGroup:
        """The next replica (the lowest free index), planned, not started, not joined."""
        used = {g.index for g in self.replicas}
        index = next(i for i in range(len(used) + 1) if i not in used)
        address, specs = self.layout.replica(index)
        children = [self.host.make(s) for s in specs]
        return ReplicaGroup(index, address, children[0], children[1:], joined=False)

    def others(self, group: ReplicaGroup) -> list[ReplicaGroup]:
        return [g for g in self.replicas if g is not group and g.joined and not g.cordoned]

    def live_routers(self) -> list[RouterChild]:
        return [r for r in self.routers if r.child.alive]

    def describe(self) -> dict:
        return {"backend": self.host.backend,
                "data_parallel_size": len([g for g in self.replicas if g.joined and not g.cordoned]),
                "replicas": [{"index": g.index, "address": g.address, "joined": g.joined, "cordoned": g.cordoned,
                              "children": [c.describe() for c in g.children]} for g in self.replicas],
                "routers": [r.child.describe() for r in self.routers]}


def assemble(host: MeshHost, layout: MeshLayout, token: str) -> ServeMesh:
    """The mesh serve starts, planned on its host (not started): --data-parallel-size replicas and
    --api-server-count routers, each router with its control port."""
    replicas = []
    for r in range(layout.args.data_parallel_size):
        address, specs = layout.replica(r)
        services = [host.make(s) for s in specs]
        replicas.append(ReplicaGroup(r, address, services[0], services[1:]))
    specs = layout.routers([g.address for g in replicas])
    routers = [RouterChild(host.make(s), f"127.0.0.1:{port}") for s, port in zip(specs, layout.control_ports)]
    return ServeMesh(host, layout, replicas, routers, MeshRPC(token))


def build(args, layout: MeshLayout, env: dict[str, str], signals, metrics, token: str) -> ServeMesh:
    """The mesh of the mp backend, supervised by a LocalMesh (started by its run())."""
    local = LocalMesh([], args.restart_policy, args.shutdown_timeout, metrics, signals, env=env)
    mesh = assemble(local, layout, token)
    services = [*(c for g in mesh.replicas for c in g.children), *(r.child for r in mesh.routers)]
    local.children = cast(list[Child], services)  # (local.make made them)
    return mesh
