"""The driver's handle on one service of a Ray mesh: its actor (stagemesh.entry.ray_actor.ServiceActor), its placement
group (a stage's), what serve's supervision last read of it, and what serve's operations drive through it (the
same hands as on a local child, stagemesh.entry.supervisor.Child: stagemesh.entry.ops.mesh.Service). Every call to
the actor has a deadline; an actor that does not answer reads as running nothing."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from stagemesh.entry.layout import ChildSpec

log = logging.getLogger("stagemesh.serve")
CALL_TIMEOUT_S = 2.0  # an operation's call to an actor (they all return at once)
STATUS_TIMEOUT_S = 10.0  # the supervision's read of an actor's status
KILL_TIMEOUT_S = 15.0


def _ray():
    import ray  # (imported by stagemesh.entry.ray_executor before any service exists)

    return ray


@dataclass(eq=False)
class RayService:
    spec: ChildSpec
    env: dict[str, str]  # what the actor adds to its environment (the spec's own and the mesh's)
    argv: list[str] = field(default_factory=list)  # its command line (NODE_IP filled in by the actor)
    actor: Any = None  # its ray ActorHandle, once started (ray is untyped: its methods are made at run time)
    group: object | None = None  # the stage's placement group
    status: dict = field(default_factory=dict)
    unavailable: bool = False  # the last status read got no answer (Ray restarts or re-places it)
    removed: bool = False  # taken out of the mesh (scale-in): its actor's death is expected

    def __post_init__(self) -> None:
        self.argv = self.argv or list(self.spec.argv)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def kind(self) -> str:
        return self.spec.kind

    @property
    def restarts(self) -> int:
        return self.status.get("restarts", 0)

    def _call(self, method: str, *args, timeout: float = CALL_TIMEOUT_S):
        """The actor method's answer; None when the actor does not answer in time (or is gone)."""
        ray = _ray()
        if self.actor is None:
            return None
        try:
            return ray.get(getattr(self.actor, method).remote(*args), timeout=timeout)
        except ray.exceptions.RayError as err:
            log.debug("%s: %s() got no answer: %s", self.name, method, str(err).splitlines()[0])
            return None

    # -- stagemesh.entry.ops.mesh.Service ----------------------------------------------------------------------
    @property
    def pid(self) -> int:
        return self._call("pid") or 0

    @property
    def alive(self) -> bool:
        return self.pid != 0

    @property
    def exit_code(self) -> int | None:
        status = self._call("status")
        return None if status is None else status["exit_code"]

    def terminate_once(self) -> None:
        self._call("terminate")

    def signal(self, signum: int) -> None:
        self._call("signal", signum)

    def kill(self) -> None:
        self._call("kill", timeout=KILL_TIMEOUT_S)

    def hold(self, held: bool) -> bool:
        return bool(self._call("hold", held))

    def start_again(self) -> bool:
        return bool(self._call("start_again"))

    def set_argv(self, argv: list[str]) -> None:
        self.argv = argv
        if self.actor is not None and not self._call("set_argv", argv):
            log.warning("%s did not take its new command line (it keeps the old one if Ray restarts it)", self.name)

    def describe(self) -> dict:
        s = self.status
        return {"name": self.name, "pid": s.get("pid") or None, "restarts": self.restarts, "held": s.get("held", False),
                "node": s.get("node_ip")}

    # -- serve's supervision -----------------------------------------------------------------------------
    def look(self, restarts) -> str | None:
        """Read the actor's status; log what changed. Returns why the mesh must stop, if it must."""
        ray = _ray()
        try:
            status = ray.get(self.actor.status.remote(), timeout=STATUS_TIMEOUT_S)
        except ray.exceptions.ActorDiedError as err:
            if self.removed:
                return None
            return (f"{self.name}'s Ray actor died and will not be restarted: {str(err).splitlines()[0]}; stopping "
                    "the mesh")
        except (ray.exceptions.ActorUnavailableError, ray.exceptions.GetTimeoutError, ray.exceptions.RayActorError):
            if not self.unavailable and not self.removed:
                log.warning("%s (node %s) does not answer: Ray is restarting it, or placing it again if its node "
                            "left the cluster", self.name, self.status.get("node_ip", "?"))
            self.unavailable = True
            return None
        before, self.status, self.unavailable = self.status, status, False
        if status["actor_pid"] != before.get("actor_pid") or status["node_id"] != before.get("node_id"):
            moved = status["node_ip"] != before.get("node_ip")
            log.warning("%s restarted by Ray on node %s%s", self.name, status["node_ip"],
                        f" (it ran on {before.get('node_ip')})" if moved else "")
            restarts.labels(self.name).inc()
        elif status["restarts"] > before.get("restarts", 0):
            restarts.labels(self.name).inc(status["restarts"] - before.get("restarts", 0))
        return f"{self.name} on node {status['node_ip']}: {status['stopped']}" if status["stopped"] else None
