"""Adding and removing data-parallel replicas while the mesh serves.

Scale-out: a new scheduler and its stages start (the next free replica index, the first replicas' command
lines); once its pipeline has formed, every router is told, and the replica gets work once each finds it
healthy. Scale-in (the highest index first): the routers stop sending the replica new requests (cordoned),
its scheduler is SIGTERMed and drains (its requests finish, or at its --shutdown-timeout are handed back as
UNAVAILABLE and continued, token-exact, on another replica by their routers; a scheduler that dies instead
hands them back the same way), its stages stop, and the routers forget it.
"""
from __future__ import annotations

import logging
from functools import partial
from typing import Callable

from stagemesh.core.errors import StagemeshError
from stagemesh.entry.ops.mesh import ReplicaGroup, ServeMesh
from stagemesh.entry.ops.operation import Cancelled, Failed, Operation, Progress, Refused
from stagemesh.entry.ops.steps import READY_TIMEOUT_S, ROUTER_SYNC_TIMEOUT_S, routers_see, stop_child, stop_children, \
    sync_routers

log = logging.getLogger("stagemesh.serve")


def serving(mesh: ServeMesh) -> list[ReplicaGroup]:
    """The replicas that take new requests (joined, not cordoned)."""
    return [g for g in mesh.replicas if g.joined and not g.cordoned]


def check_scale(mesh: ServeMesh, n: int, bounds: tuple[int, int] | None = None) -> None:
    """Refused (400) for a size the mesh cannot have; `bounds`: the autoscaler's (min, max), when it runs."""
    args = mesh.args
    if n < 1:
        raise Refused(400, f"--data-parallel-size {n}: a mesh needs at least one replica (to stop serving, stop "
                           "`stagemesh serve`: it drains)")
    if args.prefill_replicas and n <= args.prefill_replicas:
        raise Refused(400, f"--data-parallel-size {n}: with --prefill-replicas {args.prefill_replicas} the mesh "
                           f"needs {args.prefill_replicas + 1} replicas at least (every prefill replica and one "
                           "decode replica)")
    if args.enable_expert_parallel:
        raise Refused(400, "scaling is not built for --enable-expert-parallel: the experts' layout (over each "
                           "stage's TP ranks, or with -dp > 1 over the replicas' stages as one group) is fixed at "
                           "start")
    if bounds is not None and not bounds[0] <= n <= bounds[1]:
        raise Refused(400, f"--data-parallel-size {n}: the autoscaler keeps the replicas between "
                           f"--autoscale-min-replicas {bounds[0]} and --autoscale-max-replicas {bounds[1]}")
    check_room(mesh, n)


def check_room(mesh: ServeMesh, n: int) -> None:
    """Refused (400) when the host (its GPUs) or the Ray cluster (its free CPUs and GPUs) has no room for n
    replicas."""
    why = mesh.host.missing_room(n, len(serving(mesh)), mesh.layout.stages())
    if why is not None:
        raise Refused(400, f"--data-parallel-size {n}: {why}" if mesh.host.backend == "ray" else why)


def scale(mesh: ServeMesh, n: int, reason: str) -> Operation | None:
    """The operation that brings the mesh to n serving replicas (None: it has them)."""
    now = serving(mesh)
    if n == len(now):
        return None
    description = f"scale from {len(now)} to {n} replica(s) ({reason})"
    steps: list[tuple[str, Callable[[Progress], object]]]
    if n > len(now):
        steps = [(f"add a replica ({i + 1} of {n - len(now)})", partial(add_replica, mesh))
                 for i in range(n - len(now))]
    else:
        gone = sorted(now, key=lambda g: g.index)[n:][::-1]
        steps = [(f"remove {g.name}", partial(_remove, mesh, g)) for g in gone]
    return Operation("scale", description, steps)


def _remove(mesh: ServeMesh, group: ReplicaGroup, p: Progress) -> None:
    remove_replica(mesh, p, group)


def add_replica(mesh: ServeMesh, p: Progress) -> ReplicaGroup:
    group = mesh.new_replica()
    mesh.replicas.append(group)
    log.info("adding %s: %s", group.name, ", ".join(c.name for c in group.children))
    try:
        if not mesh.host.add(group.children):
            raise Cancelled()
    except StagemeshError:  # (the host took back what it had placed)
        mesh.replicas.remove(group)
        raise
    try:
        p.wait_until(lambda: _formed(mesh, group), READY_TIMEOUT_S,
                     f"{group.name}'s scheduler and stages to start and form its pipeline")
    except Failed:
        _discard(mesh, p, group)
        raise
    group.joined = True
    mesh.changed()
    sync_routers(mesh, p)
    try:
        p.wait_until(lambda: routers_see(mesh, group), ROUTER_SYNC_TIMEOUT_S, f"every router to find {group.name} "
                     "healthy")
    except Failed as err:  # it serves through the routers that do
        log.warning("%s", err)
    log.info("%s serves", group.name)
    return group


def _formed(mesh: ServeMesh, group: ReplicaGroup) -> bool:
    view = mesh.rpc.scheduler(group.address)
    return view is not None and view.serving


def remove_replica(mesh: ServeMesh, p: Progress, group: ReplicaGroup) -> None:
    group.cordoned = True
    mesh.changed()
    sync_routers(mesh, p)  # no new request goes there
    stop_child(mesh, p, group.scheduler)  # its requests finish, or go on elsewhere
    stop_children(mesh, p, group.stages)
    _discard(mesh, p, group)
    log.info("%s removed", group.name)


def _discard(mesh: ServeMesh, p: Progress, group: ReplicaGroup) -> None:
    """Stop what is left of the replica and forget it (the routers too, if they knew it)."""
    left = [c for c in group.children if c.alive]
    if left:
        stop_children(mesh, p, left)
    joined = group.joined
    mesh.replicas.remove(group)
    mesh.host.remove(group.children)
    mesh.rpc.forget(group.address)
    if joined:
        mesh.changed()
        sync_routers(mesh, p)
