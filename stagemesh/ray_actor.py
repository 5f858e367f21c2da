"""The Ray actor that runs one service of the mesh (`stagemesh <service> ...`) on the node Ray placed it on.

The actor is a supervisor, not a server: the service is its child process, started and restarted with
the same policy as `stagemesh serve`'s own children (stagemesh.supervisor), and talks gRPC exactly as
it does elsewhere. When the actor itself dies (its node left the cluster, it was killed), Ray restarts
it (max_restarts), on the same node or, for a stage whose placement group Ray moved, on another one; the
new child registers again and the scheduler's recovery takes it from there. Everything the driver and
the actor exchange is strings and numbers: the mesh's own traffic never goes through Ray.
"""
from __future__ import annotations

import logging
import os
import platform
import threading
import time

from stagemesh.supervisor import Child

log = logging.getLogger("stagemesh.serve")
TICK_S = 0.2
# In a command line: the address of the node Ray placed the service on, filled in by the actor.
NODE_IP = "{node_ip}"


class ServiceActor:
    """Started by stagemesh.ray_executor with ray.remote(...).options(...): one per service."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], policy: str):
        import ray

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        self.name, self.policy = name, policy
        self.node_ip = ray.util.get_node_ip_address()
        self.node_id = ray.get_runtime_context().get_node_id()
        self.started = time.time()
        self.stopped_because = ""
        argv = [a.replace(NODE_IP, self.node_ip) for a in argv]
        # Ray gives the actor its GPUs in CUDA_VISIBLE_DEVICES (and its CPU count in OMP_NUM_THREADS): the
        # child inherits them with the rest of the actor's environment
        self.child = Child(name, argv, {**os.environ, "PYTHONUNBUFFERED": "1", **env})
        self._lock = threading.Lock()
        self.child.start()
        threading.Thread(target=self._supervise, name=f"supervise {name}", daemon=True).start()

    def __repr__(self) -> str:  # Ray prefixes the child's log lines with it: "(stage[0.1] pid=..., ip=...)"
        return self.name

    def _supervise(self) -> None:
        while not self.stopped_because:
            with self._lock:
                if not self.stopped_because:
                    self.stopped_because = self.child.tick(time.monotonic(), self.policy) or ""
            time.sleep(TICK_S)

    def status(self) -> dict:
        """What the driver reads each second: where the service runs, whether it does, and why it stopped."""
        from stagemesh import __version__

        proc = self.child.proc
        return {"name": self.name, "node_ip": self.node_ip, "node_id": self.node_id, "actor_pid": os.getpid(),
                "actor_started": self.started, "pid": proc.pid if proc is not None else 0,
                "restarts": self.child.restarts, "stopped": self.stopped_because, "version": __version__,
                "python": platform.python_version()}

    def stop(self, timeout: float) -> bool:
        """Stop the service (SIGTERM, SIGKILL after `timeout`) and supervise no more."""
        with self._lock:
            self.stopped_because = self.stopped_because or "stopped by the driver"
            self.child.stop(timeout)
        return True
