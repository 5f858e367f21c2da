"""One supervised child process of the mesh (`stagemesh <service> ...`) and its restart policy.

`stagemesh serve` keeps every child of the mp backend here; on the Ray backend each Ray actor keeps
its one child here (stagemesh.entry.ray_actor), so both restart a dead service the same way: with backoff
(1 s doubling to 30 s, back to 1 s after a minute of good running), except when it exited with code 2
(a configuration it refuses: no restart can fix it) or under `--restart-policy never`. A child dies
with the thread that started it (PR_SET_PDEATHSIG), so none outlives its supervisor: the child sets it itself
as its command line starts (die_with_parent), because a supervisor that talks gRPC (serve's operations) must not
run code between fork and exec (gRPC's fork handlers there abort the child now and then); without a preexec_fn
the child is started with vfork and nothing runs before its exec. With STAGEMESH_WORKER_MULTIPROC_METHOD=forkserver
the children are forked by a fork server instead (stagemesh.entry.forkserver), which is their parent then.
"""
from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field

from stagemesh.entry.forkserver import ForkedProcess, spawn_stagemesh

log = logging.getLogger("stagemesh.serve")

RESTART_BACKOFF_S = (1.0, 30.0)  # first and longest wait before a dead child starts again
STABLE_AFTER_S = 60.0  # a child that ran this long restarts after the first wait again
EXIT_REFUSED = 2  # a bad flag, model or port: the child's own error says which
PARENT_ENV = "STAGEMESH_SUPERVISOR_PID"  # the supervisor's pid, in a child's environment (die_with_parent)


@dataclass
class Child:
    name: str
    argv: list[str]
    env: dict[str, str]
    kind: str = "stage"  # router, scheduler or stage
    proc: subprocess.Popen | ForkedProcess | None = field(default=None, repr=False)
    started: float = 0.0
    failures: int = 0  # deaths in a row, each within STABLE_AFTER_S of its start
    restart_at: float | None = None  # a dead child's next start
    restarts: int = 0
    held: bool = False  # an operation (a rolling restart, a scale-in) runs it: no restart, no policy
    terminated: int | None = None  # the pid it sent SIGTERM to (terminate_once)
    refused: bool = False  # it exited with EXIT_REFUSED: the mesh stops, and serve exits with that code too

    def start(self) -> None:
        # a process group of its own: a terminal's Ctrl-C (SIGINT to the whole foreground group) reaches only
        # the supervisor, which drains its children in order rather than all of them at once
        self.proc = spawn_stagemesh(self.argv, env=self.env, process_group=True, parent_env=PARENT_ENV)
        self.started, self.restart_at = time.monotonic(), None
        log.info("started %s (pid %d): stagemesh %s", self.name, self.proc.pid, " ".join(self.argv))

    @property
    def running(self) -> bool:
        return self.proc is not None

    @property
    def alive(self) -> bool:
        """The process runs now (running: it is started, and not yet seen dead)."""
        return self.proc is not None and self.proc.poll() is None

    @property
    def pid(self) -> int:
        """The running process's pid; 0 when none runs."""
        return self.proc.pid if self.proc is not None and self.alive else 0

    @property
    def exit_code(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def set_argv(self, argv: list[str]) -> None:
        """The command line it starts with from now on."""
        self.argv = argv

    def describe(self) -> dict:
        return {"name": self.name, "pid": self.pid or None, "restarts": self.restarts, "held": self.held}

    def kill(self, wait_s: float = 10.0) -> None:
        """SIGKILL and reap."""
        if self.proc is not None and self.alive:
            self.proc.kill()
            self.proc.wait(wait_s)

    def signal(self, signum: int) -> None:
        if self.proc is not None and self.alive:
            self.proc.send_signal(signum)

    def terminate_once(self) -> None:
        """SIGTERM, unless this process already had it (a second one would cut its drain short)."""
        if self.proc is not None and self.alive and self.terminated != self.proc.pid:
            self.terminated = self.proc.pid
            self.proc.send_signal(signal.SIGTERM)

    def tick(self, now: float, policy: str) -> str | None:
        """One look at the child: schedule or make its restart. Returns why the mesh must stop, if it must."""
        code = self.proc.poll() if self.proc is not None else None
        if code is not None:
            self.proc, self.refused = None, code == EXIT_REFUSED
            if policy == "never":
                return f"{self.name} exited with code {code}; stopping the mesh (--restart-policy never)"
            if code == EXIT_REFUSED:
                return (f"{self.name} exited with code 2 (its configuration is refused: see its error above); "
                        "stopping the mesh")
            self.failures = 1 if now - self.started > STABLE_AFTER_S else self.failures + 1
            wait = min(RESTART_BACKOFF_S[0] * 2 ** (self.failures - 1), RESTART_BACKOFF_S[1])
            self.restart_at = now + wait
            log.error("%s exited with code %d; restarting it in %.0fs (the rest keep serving)", self.name, code, wait)
        elif self.proc is None and self.restart_at is not None and now >= self.restart_at:
            self.start()
            self.restarts += 1
        return None

    def stop(self, timeout: float) -> None:
        """SIGTERM, then SIGKILL after `timeout` seconds."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            log.warning("%s did not stop in time: killing it", self.name)
            self.proc.kill()
            self.proc.wait()


def stop_all(children: list[Child], timeout: float = 15.0) -> None:
    """Stop every running child, the last started first, within `timeout` seconds in all."""
    running = [c for c in children if c.proc is not None and c.proc.poll() is None]
    for child in reversed(running):
        child.signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for child in running:
        child.stop(max(deadline - time.monotonic(), 0.1))


def die_with_parent() -> None:
    """In a child a supervisor started (its pid in the environment): SIGTERM when the thread that started it
    ends; exit at once if that already happened."""
    parent = os.environ.pop(PARENT_ENV, None)
    if parent is None:
        return
    try:
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        return
    if os.getppid() != int(parent):
        raise SystemExit("stagemesh: the supervisor that started this service is gone")
