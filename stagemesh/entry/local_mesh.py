"""The mesh of `stagemesh serve --distributed-executor-backend mp`: every service a child process of this one.

A child that dies is restarted with backoff (stagemesh.entry.supervisor) while the others go on serving. Told to
stop (SIGTERM or SIGINT), the mesh drains front to back: the routers first (they take no new connections and
let their streams finish, at most --shutdown-timeout), then the schedulers and the stages (by then idle; any
request still running is left to them to finish or hand back); every child is gone when serve exits 0. A second
signal ends the drain at once: it is passed on to every child, which ends its own drain, and what is left is
killed. While it serves, operations (stagemesh.entry.ops: a rolling restart, scaling) add, hold and remove children;
the drain ends a running operation first, and nothing starts once serve was told to stop.
"""
from __future__ import annotations

import logging
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from stagemesh.entry import forkserver
from stagemesh.entry.layout import ChildSpec
from stagemesh.entry.supervisor import EXIT_REFUSED, Child, stop_all

log = logging.getLogger("stagemesh.serve")
TICK_S = 0.2
EXIT_SLACK_S = 10.0  # past a drain's --shutdown-timeout, what a child has to exit before it is killed
START_WAIT_S = 30.0  # an operation's wait for the supervision loop to start its children


@dataclass
class Signals:
    """SIGTERM / SIGINT as serve counts them: the first drains, a second hurries."""
    count: int = 0
    last: int = 0

    def install(self) -> "Signals":
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on)
        return self

    def _on(self, signum: int, _frame) -> None:
        self.count, self.last = self.count + 1, signum


@dataclass
class _Start:
    children: list[Child]
    started: bool = False
    done: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        for child in self.children:
            child.start()
        self.started = True
        self.done.set()


@dataclass
class LocalMesh:
    children: list[Child]
    policy: str  # --restart-policy
    shutdown_timeout_s: float
    metrics: tuple  # (up gauge, restarts counter)
    signals: Signals = field(default_factory=Signals)
    env: dict[str, str] = field(default_factory=dict)  # every child's base environment (the internal token in it)
    backend: str = "mp"
    # held while the children change (the supervision loop, an operation's add / start / remove)
    lock: threading.RLock = field(default_factory=threading.RLock)
    before_drain: list[Callable[[], None]] = field(default_factory=list)  # e.g. end a running operation
    _starts: list["_Start"] = field(default_factory=list)  # children an operation asked to start
    _thread: threading.Thread | None = None  # the supervising thread (run's)

    def run(self) -> int:
        """Start every child and keep them up until a signal (then drain) or a death the policy will not mend."""
        self._thread = threading.current_thread()
        forkserver.prestart([child.env for child in self.children])
        try:
            for child in list(self.children):
                if not self.start(child):  # told to stop during start-up: start no more
                    break
            code = self._supervise()
            with self.lock:  # from here on nothing starts
                for request in self._starts:
                    request.done.set()
                self._starts.clear()
            for hook in self.before_drain:
                hook()
            if self.signals.count:
                self._drain()
            return code
        finally:
            with self.lock:
                stop_all(self.children)

    @property
    def stopping(self) -> bool:
        return self.signals.count > 0

    def start(self, child: Child) -> bool:
        """Start (or start again) a child of the mesh; False, starting nothing, once serve was told to stop."""
        return self._start_on_main([child])

    def add(self, children: list[Child]) -> bool:
        """Add children and start them; False, starting none, once serve was told to stop."""
        with self.lock:
            if self.stopping:
                return False
            self.children = [*self.children, *children]
        return self._start_on_main(children)

    def _start_on_main(self, children: list[Child]) -> bool:
        """Children start on the thread that supervises them: a child dies with the thread that started it
        (PR_SET_PDEATHSIG), and an operation's thread ends long before the mesh does."""
        request = _Start(children)
        with self.lock:
            if self.stopping:
                return False
            if threading.current_thread() is self._thread:
                request.run()
            else:
                self._starts.append(request)
        if not request.done.wait(START_WAIT_S):
            log.warning("starting %s: the supervision loop did not take it within %.0fs",
                        ", ".join(c.name for c in children), START_WAIT_S)
        return request.started

    def make(self, spec: ChildSpec) -> Child:
        """A child planned, not started (add() or run() starts it)."""
        return Child(spec.name, spec.argv, {**self.env, **spec.env}, spec.kind)

    def hold(self, children: list[Child], held: bool) -> None:
        """An operation runs these children (the supervision neither restarts them nor reads their exit), or no
        more."""
        with self.lock:
            for child in children:
                child.held = held

    def missing_room(self, replicas: int, now: int, stages: list[ChildSpec]) -> str | None:
        """Why this host cannot run `replicas` replicas of these stages (its GPUs), or None."""
        need = replicas * sum(s.gpus for s in stages)
        if not need:
            return None
        import torch

        have = torch.cuda.device_count()
        return None if need <= have else (f"--data-parallel-size {replicas} needs {need} GPUs (TP x PP per replica); "
                                          f"this host has {have}")

    def remove(self, children: list[Child]) -> None:
        """Forget children (an operation stopped them)."""
        with self.lock:
            self.children = [c for c in self.children if c not in children]

    def _supervise(self) -> int:
        while not self.signals.count:
            with self.lock:
                reason = self._tick(time.monotonic())
            if reason is not None:
                log.error("%s", reason)
                return EXIT_REFUSED if any(c.refused for c in self.children) else 1
            time.sleep(TICK_S)
        return 0

    def _tick(self, now: float) -> str | None:
        up, restarts = self.metrics
        for request in self._starts:
            request.run()
        self._starts.clear()
        for child in self.children:
            if child.held:  # an operation runs it
                continue
            before = child.restarts
            reason = child.tick(now, self.policy)
            if reason is not None:
                return reason
            if child.restarts > before:
                restarts.labels(child.name).inc()
            up.labels(child.name).set(1 if child.running else 0)
        return None

    def _drain(self) -> None:
        with self.lock:
            children = list(self.children)
        drain(children, self.shutdown_timeout_s, self.signals)


def drain(services: list, timeout_s: float, signals: Signals) -> None:
    """Front to back: SIGTERM the routers and wait for them to exit (at most `timeout_s`, --shutdown-timeout, and
    EXIT_SLACK_S), then the schedulers and stages the same way. A second signal ends the drain at once: it is
    passed on to every service (a second SIGTERM ends a service's own drain). `services`: local children or
    services under Ray actors (stagemesh.entry.ops.mesh.Service, with signal())."""
    log.info("signal %d: draining the mesh, the routers first (at most %.0fs each step; a second signal ends "
             "the drain at once)", signals.last, timeout_s)
    routers = [s for s in services if s.kind == "router"]
    rest = [s for s in services if s.kind != "router"]
    for group, what in ((routers, "the routers"), (rest, "the schedulers and stages")):
        if not _drain_group(group, what, services, timeout_s, signals):
            return


def _drain_group(group: list, what: str, services: list, timeout_s: float, signals: Signals) -> bool:
    """SIGTERM the group and wait for it to exit; False when a second signal cut the drain short."""
    for service in group:
        service.terminate_once()  # (one an operation is draining already goes on draining)
    deadline = time.monotonic() + timeout_s + EXIT_SLACK_S
    last_log, alive = time.monotonic(), [s for s in group if s.alive]
    while alive and time.monotonic() < deadline:
        if signals.count > 1:
            log.warning("second signal: ending the drain now")
            for service in services:
                service.signal(signal.SIGTERM)  # a service's second signal ends its own drain
            return False
        if time.monotonic() - last_log > 5:
            last_log = time.monotonic()
            log.info("draining: waiting for %s (%s)", what, ", ".join(s.name for s in alive))
        time.sleep(TICK_S / 2)
        alive = [s for s in alive if s.alive]
    if alive:
        log.warning("draining: %s did not exit in time: %s", what, ", ".join(s.name for s in alive))
    else:
        log.info("drained %s", what)
    return True
