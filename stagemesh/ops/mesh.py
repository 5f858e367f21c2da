"""The serve mesh as its operations see it: the replicas (each a scheduler and its stages, by index), the routers
(each with its control port), and what every router is to balance over."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

from stagemesh.layout import MeshLayout
from stagemesh.local_mesh import LocalMesh
from stagemesh.ops.rpc import MeshRPC
from stagemesh.supervisor import Child

log = logging.getLogger("stagemesh.serve")


@dataclass
class ReplicaGroup:
    index: int
    address: str  # its scheduler's host:port
    scheduler: Child
    stages: list[Child]
    joined: bool = True  # the routers know it (a replica being added joins once it is ready)
    cordoned: bool = False  # the routers send it no new request (it is being removed)

    @property
    def children(self) -> list[Child]:
        return [self.scheduler, *self.stages]

    @property
    def name(self) -> str:
        return f"replica {self.index} ({self.address})"


@dataclass
class RouterChild:
    child: Child
    control: str  # its control port, host:port (router.control)


@dataclass
class ServeMesh:
    local: LocalMesh
    layout: MeshLayout
    env: dict[str, str]  # every child's base environment (the internal token in it)
    replicas: list[ReplicaGroup]
    routers: list[RouterChild]
    rpc: MeshRPC
    version: int = 0  # of what the routers are to balance over: one more at each change
    acked: dict[str, tuple[int, int]] = field(default_factory=dict)  # router -> (its pid, the version it took)

    @property
    def shutdown_timeout_s(self) -> float:
        return self.local.shutdown_timeout_s

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
            router.child.argv = spec.argv

    def new_replica(self) -> ReplicaGroup:
        """The next replica (the lowest free index), planned, not started, not joined."""
        used = {g.index for g in self.replicas}
        index = next(i for i in range(len(used) + 1) if i not in used)
        address, specs = self.layout.replica(index)
        children = [Child(s.name, s.argv, {**self.env, **s.env}, s.kind) for s in specs]
        return ReplicaGroup(index, address, children[0], children[1:], joined=False)

    def others(self, group: ReplicaGroup) -> list[ReplicaGroup]:
        return [g for g in self.replicas if g is not group and g.joined and not g.cordoned]

    def live_routers(self) -> list[RouterChild]:
        return [r for r in self.routers if r.child.alive]

    def describe(self) -> dict:
        return {"data_parallel_size": len([g for g in self.replicas if g.joined and not g.cordoned]),
                "replicas": [{"index": g.index, "address": g.address, "joined": g.joined, "cordoned": g.cordoned,
                              "children": [_child(c) for c in g.children]} for g in self.replicas],
                "routers": [_child(r.child) for r in self.routers]}


def _child(c: Child) -> dict:
    pid = c.proc.pid if c.proc is not None and c.alive else None
    return {"name": c.name, "pid": pid, "restarts": c.restarts, "held": c.held}


def build(args, layout: MeshLayout, env: dict[str, str], signals, metrics, token: str) -> ServeMesh:
    """The mesh serve starts: --data-parallel-size replicas and --api-server-count routers, each router with its
    control port, supervised by a LocalMesh (started by its run())."""
    replicas = []
    for r in range(args.data_parallel_size):
        address, specs = layout.replica(r)
        children = [Child(s.name, s.argv, {**env, **s.env}, s.kind) for s in specs]
        replicas.append(ReplicaGroup(r, address, children[0], children[1:]))
    specs = layout.routers([g.address for g in replicas])
    routers = [RouterChild(Child(s.name, s.argv, {**env, **s.env}, s.kind), f"127.0.0.1:{port}")
               for s, port in zip(specs, layout.control_ports)]
    local = LocalMesh([c for g in replicas for c in g.children] + [r.child for r in routers], args.restart_policy,
                      args.shutdown_timeout, metrics, signals)
    return ServeMesh(local, layout, env, replicas, routers, MeshRPC(token))
