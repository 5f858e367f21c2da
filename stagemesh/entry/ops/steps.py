"""The building blocks of the operations: stop a service (it drains), restart one and wait until it serves again,
tell the routers the replicas, and the readiness each kind of service is judged by. Every wait is bounded and says
what it waits for (ops.operation.Progress). A service is a local child or one under a Ray actor
(ops.mesh.Service); the mesh's host holds it meanwhile, so that its supervisor does not restart it."""
from __future__ import annotations

import logging
from typing import Callable

from stagemesh.entry.local_mesh import EXIT_SLACK_S
from stagemesh.entry.ops.mesh import ReplicaGroup, RouterChild, ServeMesh, Service
from stagemesh.entry.ops.operation import Cancelled, Failed, Progress

log = logging.getLogger("stagemesh.serve")
READY_TIMEOUT_S = 300.0  # a started service: its start-up, its weights, its pipeline formed
OTHERS_TIMEOUT_S = 120.0  # another replica (or router) ready to take the load before one is stopped
ROUTER_SYNC_TIMEOUT_S = 30.0


def stop_child(mesh: ServeMesh, p: Progress, child: Service) -> None:
    """SIGTERM (the service drains), and wait for it to exit: at most its --shutdown-timeout and a little more,
    then SIGKILL. The service stays held (not restarted by its supervisor) until the caller lets it go."""
    mesh.host.hold([child], True)
    child.terminate_once()
    try:
        p.wait_until(lambda: not child.alive, mesh.shutdown_timeout_s + EXIT_SLACK_S, f"{child.name} to drain and exit")
    except Failed:
        log.warning("%s did not exit within its --shutdown-timeout and %.0fs: killing it", child.name, EXIT_SLACK_S)
        child.kill()
    log.info("%s exited with code %s", child.name, child.exit_code)


def stop_children(mesh: ServeMesh, p: Progress, children: list[Service]) -> None:
    """stop_child for several at once (a replica's stages, whose scheduler is gone)."""
    mesh.host.hold(children, True)
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
                child.kill()


def restart_child(mesh: ServeMesh, p: Progress, child: Service, ready: Callable[[], bool], what: str) -> None:
    """Stop the service (it drains), start it again with the same command line, and wait until ready()."""
    try:
        stop_child(mesh, p, child)
        if not mesh.host.start(child):
            raise Cancelled()
        mesh.host.hold([child], False)  # started: if it dies now, its supervisor restarts it as any other
        p.wait_until(lambda: child.alive and ready(), READY_TIMEOUT_S, what)
    finally:
        mesh.host.hold([child], False)


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
        for router in mesh.routers:
            pid = router.child.pid
            if not pid:
                continue
            key = (pid, version)
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
