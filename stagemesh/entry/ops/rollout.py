"""A rolling restart of every service of the mesh, one at a time, under load, losing nothing: the stages (replica
by replica, so that another replica serves meanwhile), then the schedulers, then the routers. Each child is
SIGTERMed (it drains: see ARCHITECTURE.md, contract 8), waited for, started again with the same command line
(so a new version of stagemesh installed meanwhile is what starts), and waited for until it serves again: a
stage until its replica serves in a new pipeline epoch and every router finds it healthy, a scheduler until it
serves and the routers find it healthy, a router until its own readiness is back. Nothing of a replica stops
before another replica is ready for its new requests, nor a router before another router is ready.

A mesh of one replica has no other replica to serve meanwhile: --surge adds one for the rollout's time (the
last step removes it). A mesh of one router has no other router: its restart refuses new connections for a
moment and cuts the streams that outlast its --shutdown-timeout, which resuming clients resume."""
from __future__ import annotations

from functools import partial
from typing import Callable

from stagemesh.entry.ops.mesh import ReplicaGroup, RouterChild, ServeMesh, Service
from stagemesh.entry.ops.operation import Operation, Progress, Refused
from stagemesh.entry.ops.scaling import add_replica, check_room, remove_replica, serving
from stagemesh.entry.ops.steps import replica_ready, restart_child, wait_for_another_replica, wait_for_another_router


def check_rollout(mesh: ServeMesh, surge: bool) -> None:
    args = mesh.args
    if args.enable_expert_parallel and args.data_parallel_size > 1:
        raise Refused(400, "a rolling restart is not built for --enable-expert-parallel across replicas: their "
                           "stages form one expert group, which a restarted stage breaks for every replica")
    if surge:
        check_room(mesh, len(serving(mesh)) + 1)
    if len(serving(mesh)) < 2 and not surge:
        raise Refused(400, "a rolling restart of a mesh of one replica would leave no replica to serve while its "
                           "services restart: ask for --surge (a replica is added for the rollout's time, then "
                           "removed), or scale to 2 replicas first (stagemesh scale --data-parallel-size 2)")


def rollout(mesh: ServeMesh, surge: bool) -> Operation:
    check_rollout(mesh, surge)
    replicas = sorted(serving(mesh), key=lambda g: g.index)
    steps: list[tuple[str, Callable[[Progress], object]]] = []
    added: list[ReplicaGroup] = []
    if surge:
        steps.append(("add a replica for the rollout's time (--surge)", lambda p: added.append(add_replica(mesh, p))))
    for g in replicas:
        steps += [(f"restart {s.name}", partial(_restart_stage, mesh, g, s)) for s in g.stages]
    steps += [(f"restart {g.scheduler.name}", partial(_restart_scheduler, mesh, g)) for g in replicas]
    if surge:
        steps.append(("remove the --surge replica", lambda p: remove_replica(mesh, p, added[0])))
    steps += [(f"restart {r.child.name}", partial(_restart_router, mesh, r)) for r in mesh.routers]
    services = sum(len(g.children) for g in replicas) + len(mesh.routers)
    return Operation("rollout", f"rolling restart of {services} service(s)" + (" with a surge replica" if surge
                                                                                else ""), steps)


def _restart_stage(mesh: ServeMesh, group: ReplicaGroup, stage: Service, p: Progress) -> None:
    wait_for_another_replica(mesh, p, group)
    view = mesh.rpc.scheduler(group.address)
    epoch = view.epoch if view is not None else 0
    restart_child(mesh, p, stage, lambda: replica_ready(mesh, group, epoch),
                  f"{group.name} to serve again with the new {stage.name} (a pipeline epoch after {epoch}) and "
                  "every router to find it healthy")


def _restart_scheduler(mesh: ServeMesh, group: ReplicaGroup, p: Progress) -> None:
    wait_for_another_replica(mesh, p, group)
    restart_child(mesh, p, group.scheduler, lambda: replica_ready(mesh, group),
                  f"{group.name}'s new scheduler to form its pipeline with its stages and every router to find it "
                  "healthy")


def _restart_router(mesh: ServeMesh, router: RouterChild, p: Progress) -> None:
    wait_for_another_router(mesh, p, router)
    restart_child(mesh, p, router.child, lambda: mesh.rpc.router_ready(router.control),
                  f"{router.child.name} to be ready again (its control port's readiness)")
