"""The mesh of `stagemesh serve --distributed-executor-backend mp`: every service a child process of this one.

A child that dies is restarted with backoff (stagemesh.supervisor) while the others go on serving. Told to
stop (SIGTERM or SIGINT), the mesh drains front to back: the routers first (they take no new connections and
let their streams finish, at most --shutdown-timeout), then the schedulers and the stages (by then idle; any
request still running is left to them to finish or hand back); every child is gone when serve exits 0. A second
signal ends the drain at once: it is passed on to every child, which ends its own drain, and what is left is
killed.
"""
from __future__ import annotations

import logging
import signal
import time
from dataclasses import dataclass, field

from stagemesh.supervisor import Child, stop_all

log = logging.getLogger("stagemesh.serve")
TICK_S = 0.2
EXIT_SLACK_S = 10.0  # past a drain's --shutdown-timeout, what a child has to exit before it is killed


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
class LocalMesh:
    children: list[Child]
    policy: str  # --restart-policy
    shutdown_timeout_s: float
    metrics: tuple  # (up gauge, restarts counter)
    signals: Signals = field(default_factory=Signals)

    def run(self) -> int:
        """Start every child and keep them up until a signal (then drain) or a death the policy will not mend."""
        try:
            for child in self.children:
                if self.signals.count:  # told to stop during start-up: start no more
                    break
                child.start()
            code = self._supervise()
            if self.signals.count:
                self._drain()
            return code
        finally:
            stop_all(self.children)

    def _supervise(self) -> int:
        up, restarts = self.metrics
        while not self.signals.count:
            now = time.monotonic()
            for child in self.children:
                before = child.restarts
                reason = child.tick(now, self.policy)
                if reason is not None:
                    log.error("%s", reason)
                    return 1
                if child.restarts > before:
                    restarts.labels(child.name).inc()
                up.labels(child.name).set(1 if child.running else 0)
            time.sleep(TICK_S)
        return 0

    def _drain(self) -> None:
        log.info("signal %d: draining the mesh, the routers first (at most %.0fs each step; a second signal ends "
                 "the drain at once)", self.signals.last, self.shutdown_timeout_s)
        routers = [c for c in self.children if c.kind == "router"]
        rest = [c for c in self.children if c.kind != "router"]
        for group, what in ((routers, "the routers"), (rest, "the schedulers and stages")):
            if not self._drain_group(group, what):
                return

    def _drain_group(self, group: list[Child], what: str) -> bool:
        """SIGTERM the group and wait for it to exit; False when a second signal cut the drain short."""
        for child in group:
            child.signal(signal.SIGTERM)
        deadline = time.monotonic() + self.shutdown_timeout_s + EXIT_SLACK_S
        last_log = time.monotonic()
        while any(c.alive for c in group) and time.monotonic() < deadline:
            if self.signals.count > 1:
                log.warning("second signal: ending the drain now")
                for child in self.children:
                    child.signal(signal.SIGTERM)  # a child's second signal ends its own drain
                return False
            if time.monotonic() - last_log > 5:
                last_log = time.monotonic()
                log.info("draining: waiting for %s (%s)", what, ", ".join(c.name for c in group if c.alive))
            time.sleep(TICK_S / 2)
        left = [c.name for c in group if c.alive]
        if left:
            log.warning("draining: %s did not exit in time: %s", what, ", ".join(left))
        else:
            log.info("drained %s", what)
        return True
