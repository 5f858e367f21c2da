"""The Ray actor that runs one service of the mesh (`stagemesh <service> ...`) on the node Ray placed it on.

The actor is a supervisor, not a server: the service is its child process, started and restarted with
the same policy as `stagemesh serve`'s own children (stagemesh.entry.supervisor), and talks gRPC exactly as
it does elsewhere. When the actor itself dies (its node left the cluster, it was killed), Ray restarts
it (max_restarts), on the same node or, for a stage whose placement group Ray moved, on another one; the
new child registers again and the scheduler's recovery takes it from there. serve's operations (a rolling
restart, a drain) hold the child (its supervisor restarts it no more), SIGTERM it and start it again through
the methods below; each returns at once, and the driver polls `pid` for the outcome. Everything the driver and
the actor exchange is strings and numbers: the mesh's own traffic never goes through Ray.
"""
from __future__ import annotations

import logging
import os
import platform
import threading
import time

from stage_worker.gloo_interface import HOST_IP_ENV
from stagemesh.entry.supervisor import Child

log = logging.getLogger("stagemesh.serve")
TICK_S = 0.2
KILL_WAIT_S = 10.0
# In a command line: the address of the node Ray placed the service on, filled in by the actor.
NODE_IP = "{node_ip}"


class ServiceActor:
    """Started by stagemesh.entry.ray_executor with ray.remote(...).options(...): one per service."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], policy: str):
        import ray

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        self.name, self.policy = name, policy
        self.node_ip = ray.util.get_node_ip_address()
        self.node_id = ray.get_runtime_context().get_node_id()
        self.started = time.time()
        self.stopped_because = ""
        self.held = False  # an operation runs the child: no restart, no policy
        self._start_asked = False  # start the child again (on the supervising thread)
        # Ray gives the actor its GPUs in CUDA_VISIBLE_DEVICES (and its CPU count in OMP_NUM_THREADS): the
        # child inherits them with the rest of the actor's environment
        # and the node's address, which a stage binds gloo to (stage_worker.gloo_interface)
        self.child = Child(name, self._argv(argv), {**os.environ, "PYTHONUNBUFFERED": "1", HOST_IP_ENV: self.node_ip,
                                                    **env})
        self._lock = threading.Lock()
        self.child.start()
        threading.Thread(target=self._supervise, name=f"supervise {name}", daemon=True).start()

    def __repr__(self) -> str:  # Ray prefixes the child's log lines with it: "(stage[0.1] pid=..., ip=...)"
        return self.name

    def _argv(self, argv: list[str]) -> list[str]:
        return [a.replace(NODE_IP, self.node_ip) for a in argv]

    def _supervise(self) -> None:
        """The child starts on this thread only: a child dies with the thread that started it (PR_SET_PDEATHSIG),
        and this one lives as long as the actor."""
        while not self.stopped_because:
            with self._lock:
                if self._start_asked:
                    self._start_asked, self.held = False, False
                    self.child.start()
                elif not self.stopped_because and not self.held:
                    self.stopped_because = self.child.tick(time.monotonic(), self.policy) or ""
            time.sleep(TICK_S)

    def status(self) -> dict:
        """What the driver reads each second: where the service runs, whether it does, and why it stopped."""
        from stagemesh import __version__

        return {"name": self.name, "node_ip": self.node_ip, "node_id": self.node_id, "actor_pid": os.getpid(),
                "actor_started": self.started, "pid": self.pid(), "restarts": self.child.restarts,
                "held": self.held, "exit_code": self._exit_code(), "stopped": self.stopped_because,
                "refused": self.child.refused,
                "version": __version__, "python": platform.python_version()}

    def pid(self) -> int:
        """The running child's pid; 0 when none runs."""
        return self.child.pid

    def _exit_code(self) -> int | None:
        proc = self.child.proc
        return None if proc is None else proc.poll()

    # -- an operation's hands on the child -------------------------------------------------------------
    def hold(self, held: bool) -> bool:
        """Hold the child (its supervisor leaves it alone, dead or alive), or let the supervisor have it again."""
        with self._lock:
            self.held = held
        return True

    def terminate(self) -> bool:
        """Hold the child and SIGTERM it, once (it drains, then exits)."""
        with self._lock:
            self.held = True
            self.child.terminate_once()
        return True

    def signal(self, signum: int) -> bool:
        """Pass a signal on (a second SIGTERM ends a child's drain at once)."""
        self.child.signal(signum)
        return True

    def kill(self) -> int | None:
        """SIGKILL the child and reap it; its exit code."""
        with self._lock:
            self.held = True
            proc = self.child.proc
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(KILL_WAIT_S)
        return self._exit_code()

    def start_again(self) -> bool:
        """Start the held child again (its command line as last set) and supervise it again; False when the actor
        stopped for good or the child still runs."""
        with self._lock:
            if self.stopped_because or self.child.alive:
                return False
            self._start_asked = True
        return True

    def set_argv(self, argv: list[str]) -> bool:
        """The command line the child starts with from now on (a router's replicas changed)."""
        with self._lock:
            self.child.argv = self._argv(argv)
        return True

    def stop(self, timeout: float) -> bool:
        """Stop the service (SIGTERM, SIGKILL after `timeout`) and supervise no more."""
        with self._lock:
            self.stopped_because = self.stopped_because or "stopped by the driver"
            self.child.stop(timeout)
        return True
