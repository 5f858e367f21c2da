"""A service told to stop drains: the first SIGTERM (or SIGINT) starts a drain bounded by --shutdown-timeout,
in which the service takes no new work and lets what it runs finish (or hands it on); a second signal ends the
drain at once. Each service says what "drained" means; this is the signal, the clock and the log lines."""
from __future__ import annotations

import asyncio
import logging
import signal
import threading
import time
from typing import Callable

DEFAULT_TIMEOUT_S = 30.0
LOG_EVERY_S = 5.0
POLL_S = 0.05
FORCE_SLACK_S = 5.0  # past --shutdown-timeout, when install()'s `force_stop` ends a drain that did not end itself


HELP = ("on SIGTERM (or SIGINT) drain: readiness turns false, no new work is taken, and what runs finishes (or "
        "moves, token-exact, to another replica) for at most this long before the process exits 0; a second signal "
        f"ends the drain at once (vLLM's flag; default {DEFAULT_TIMEOUT_S:.0f})")  # --shutdown-timeout's


class Shutdown:
    def __init__(self, timeout_s: float, log: logging.Logger, what: str,
                 force_stop: Callable[[], None] | None = None):
        """`force_stop`: ends the process's work whatever its drain is doing; called on the second signal, and
        FORCE_SLACK_S after --shutdown-timeout (a backstop: the process exits even if the thread that drains it is
        gone or stuck)."""
        if timeout_s < 0:
            raise ValueError("--shutdown-timeout must be >= 0")
        self.timeout_s, self.log, self.what = timeout_s, log, what
        self.requested = threading.Event()  # the first signal came: drain
        self.hurry = threading.Event()  # a second signal came: stop draining now
        self.started_at: float | None = None
        self._force_stop = force_stop

    def install(self) -> None:
        """Handle SIGTERM and SIGINT (call on the main thread)."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda signum, _: self.signal(signum))

    def install_async(self) -> None:
        """Handle SIGTERM and SIGINT in the running event loop (a service on asyncio)."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.signal, sig)

    async def wait(self) -> None:
        """Until the first signal."""
        while not self.requested.is_set():
            await asyncio.sleep(POLL_S * 4)

    def signal(self, signum: int = signal.SIGTERM) -> None:
        if not self.requested.is_set():
            self.started_at = time.monotonic()
            self.requested.set()
            self.log.info("%s: signal %d: draining for at most %.0fs (--shutdown-timeout; a second signal ends the "
                          "drain at once)", self.what, signum, self.timeout_s)
            if self._force_stop is not None:
                backstop = threading.Timer(self.timeout_s + FORCE_SLACK_S, self._forced, ("its drain's time is up",))
                backstop.daemon = True
                backstop.start()
        elif not self.hurry.is_set():
            self.hurry.set()
            self.log.warning("%s: second signal %d: ending the drain now", self.what, signum)
            if self._force_stop is not None:
                self._force_stop()

    def _forced(self, why: str) -> None:
        self.log.warning("%s: %s: stopping", self.what, why)
        if self._force_stop is not None:
            self._force_stop()

    @property
    def left_s(self) -> float:
        if self.started_at is None:
            return self.timeout_s
        return 0.0 if self.hurry.is_set() else max(self.started_at + self.timeout_s - time.monotonic(), 0.0)

    def _over(self, drained: Callable[[], bool]) -> bool | None:
        """True: drained; False: out of time; None: go on waiting."""
        if drained():
            return True
        return False if self.left_s <= 0 else None

    def _report(self, waiting_for: Callable[[], str], last: float) -> float:
        now = time.monotonic()
        if now - last >= LOG_EVERY_S:
            self.log.info("%s: draining: waiting for %s (%.0fs left)", self.what, waiting_for(), self.left_s)
            return now
        return last

    async def drain(self, drained: Callable[[], bool], waiting_for: Callable[[], str]) -> bool:
        """Wait until drained() or the time is up (True: drained), saying what it waits for every few seconds."""
        last = time.monotonic()
        while (done := self._over(drained)) is None:
            await asyncio.sleep(POLL_S)
            last = self._report(waiting_for, last)
        self._ended(done, waiting_for)
        return done

    def drain_blocking(self, drained: Callable[[], bool], waiting_for: Callable[[], str]) -> bool:
        """drain() for a thread."""
        last = time.monotonic()
        while (done := self._over(drained)) is None:
            self.hurry.wait(POLL_S)
            last = self._report(waiting_for, last)
        self._ended(done, waiting_for)
        return done

    def _ended(self, drained: bool, waiting_for: Callable[[], str]) -> None:
        if drained:
            self.log.info("%s: drained", self.what)
        else:
            self.log.warning("%s: the drain ended with %s left", self.what, waiting_for())
