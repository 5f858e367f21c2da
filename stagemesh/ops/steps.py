"""The building blocks of the operations: stop a child (it drains), restart one and wait until it serves again,
tell the routers the replicas, and the readiness each kind of child is judged by. Every wait is bounded and says
what it waits for (ops.operation.Progress)."""
from __future__ import annotations

import logging
from typing import Callable

from stagemesh.local_mesh import EXIT_SLACK_S
from stagemesh.ops.mesh import ReplicaGroup, RouterChild, ServeMesh
from stagemesh.ops.operation import Cancelled, Failed, Progress
from stagemesh.supervisor import Child

log = logging.getLogger("stagemesh.serve")
READY_TIMEOUT_S = 300.0  # a started service: its start-up, its weights, its pipeline formed
OTHERS_TIMEOUT_S = 120.0  # another replica (or router) ready to take the load before one is stopped
ROUTER_SYNC_TIMEOUT_S = 30.0
KILL_WAIT_S = 10.0


def stop_child(mesh: ServeMesh, p: Progress, child: Child) -> None:
    """SIGTERM (the child drains), and wait for it to exit: at most its --shutdown-timeout and a little more,
    then SIGKILL. The child stays held (not restarted by the supervisor) until the caller lets it go."""
    with mesh.local.lock:
        child.held = True
    child.terminate_once()
    try:
        p.wait_until(lambda: not child.alive, mesh.shutdown_timeout_s + EXIT_SLACK_S, f"{child.name} to drain and exit")
    except Failed:
        log.warning("%s did not exit within its --shutdown-timeout and %.0fs: killing it", child.name, EXIT_SLACK_S)
        _kill(child)
    if child.proc is not None:
        log.info("%s exited with code %s", child.name, child.proc.returncode)


def stop_children(mesh: ServeMesh, p: Progress, children: list[Child]) -> None:
    """stop_child for several at once (a replica's stages, whose scheduler is gone)."""
    with mesh.local.lock:
        for child in children:
            child.held = True
    for child in children:
        child.terminate_once()
    names = ", ".join(c.name for c in children)
    try:
        p.wait_until(lambda: not any(c.alive for c in children), mesh.shutdown_timeout_s + EXIT_SLACK_S,
                     f"{names} to exit")
    except Failed:
        for child in children:
            if child.alive:
                log.warning("%s did not exit in time: killing it", child.name)
                _kill(child)


def _kill(child: Child) -> None:
    proc = child.proc
    if proc is not None:
        proc.kill()
        proc.wait(KILL_WAIT_S)


def restart_child(mesh: ServeMesh, p: Progress, child: Child, ready: Callable[[], bool], what: str) -> None:
    """Stop the child (it drains), start it again with the same command line, and wait until ready()."""
    try:
        stop_child(mesh, p, child)
        if not mesh.local.start(child):
            raise Cancelled()
        child.held = False  # started: if it dies now, the supervisor restarts it as any other
        p.wait_until(lambda: child.alive and ready(), READY_TIMEOUT_S, what)
    finally:
        child.held = False


def replica_ready(mesh: ServeMesh, group: ReplicaGroup, after_epoch: int | None = None) -> bool:
    """The replica's scheduler serves (in a pipeline epoch after `after_epoch`) and every router that answers
    finds it healthy."""
    view = mesh.rpc.scheduler(group.address)
    if view is None or not view.serving or (after_epoch is not None and view.epoch <= after_epoch):
        return False
    return routers_see(mesh, group)


def routers_see(mesh: ServeMesh, group: ReplicaGroup) -> bool:
    for router in mesh.live_routers():
        seen = mesh.rpc.router_sees(router.control)
        if seen is not None and not seen.get(group.address, False):  # (one that does not answer yet checks it
            return False  # itself before it serves)
    return True


def wait_for_another_replica(mesh: ServeMesh, p: Progress, group: ReplicaGroup) -> None:
    """Before a service of the replica stops: another replica is ready for its new requests."""
    p.wait_until(lambda: any(replica_ready(mesh, g) for g in mesh.others(group)), OTHERS_TIMEOUT_S,
                 f"another replica to be ready for {group.name}'s new requests")


def wait_for_another_router(mesh: ServeMesh, p: Progress, router: RouterChild) -> None:
    others = [r for r in mesh.routers if r is not router]
    if not others:
        log.warning("restarting the only router: new connections are refused until it is back, and a stream that "
                    "outlasts its --shutdown-timeout is cut (a client that resumes goes on: Last-Event-ID, "
                    "stagemesh.client); serve --api-server-count 2 or more cuts nothing")
        return
    p.wait_until(lambda: any(mesh.rpc.router_ready(r.control) for r in others), OTHERS_TIMEOUT_S,
                 f"another router to be ready for {router.child.name}'s connections")


def sync_routers(mesh: ServeMesh, p: Progress) -> None:
    """Tell every running router the replicas (mesh.wanted()), until each took them; a router that does not
    answer in time has them on its command line when it starts again."""
    wanted, version = mesh.wanted(), mesh.version

    def synced() -> bool:
        pending = False
        for router in mesh.live_routers():
            if router.child.proc is None:
                continue
            key = (router.child.proc.pid, version)
            if mesh.acked.get(router.child.name) == key:
                continue
            if mesh.rpc.set_replicas(router.control, wanted):
                mesh.acked[router.child.name] = key
            else:
                pending = True
        return not pending

    try:
        p.wait_until(synced, ROUTER_SYNC_TIMEOUT_S, f"every router to take the replicas {sorted(wanted)}")
    except Failed as err:
        log.warning("%s: going on (a router that did not answer starts with them on its command line)", err)
