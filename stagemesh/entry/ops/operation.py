"""One operation at a time on the mesh (a rollout, a scale), as a list of named steps run on a thread of its own;
its progress for GET /admin/status; and its end when serve is told to stop (the drain wins)."""
from __future__ import annotations

import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable

from stagemesh.core.errors import StagemeshError

log = logging.getLogger("stagemesh.serve")
LOG_EVERY_S = 5.0
POLL_S = 0.1


class Refused(StagemeshError):
    """An operation that will not start: `status` is the admin API's answer (400, 409, 503)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class Failed(StagemeshError):
    """A step that could not be done (the operation stops there, the mesh serving as it is)."""


class Cancelled(Exception):
    """serve was told to stop: the operation ends where it is and the drain takes over."""


@dataclass
class Operation:
    kind: str  # rollout or scale
    description: str
    steps: list[tuple[str, Callable[["Progress"], object]]]
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    state: str = "running"  # running, succeeded, failed, cancelled
    steps_done: int = 0
    step: str = ""
    waiting_for: str = ""
    error: str = ""
    started_at: float = field(default_factory=time.time)
    finished_at: float | None = None

    def to_dict(self) -> dict:
        return {"id": self.id, "kind": self.kind, "description": self.description, "state": self.state,
                "steps_total": len(self.steps), "steps_done": self.steps_done, "step": self.step or None,
                "waiting_for": self.waiting_for or None, "error": self.error or None,
                "started_at": self.started_at, "finished_at": self.finished_at}


class Progress:
    """What a step sees: whether to stop, where to say what it waits for, and a bounded wait."""

    def __init__(self, op: Operation, cancel: threading.Event):
        self.op, self.cancel = op, cancel

    def check(self) -> None:
        if self.cancel.is_set():
            raise Cancelled()

    def wait_until(self, ready: Callable[[], bool], timeout_s: float, what: str) -> None:
        """Until ready() (checked every POLL_S), saying what it waits for; Failed after timeout_s."""
        self.op.waiting_for = what
        log.info("%s: waiting for %s (at most %.0fs)", self.op.step, what, timeout_s)
        start = last = time.monotonic()
        while not ready():
            self.check()
            now = time.monotonic()
            if now - start > timeout_s:
                raise Failed(f"{self.op.step}: {what} did not happen within {timeout_s:.0f}s")
            if now - last >= LOG_EVERY_S:
                last = now
                log.info("%s: still waiting for %s (%.0fs left)", self.op.step, what, timeout_s - (now - start))
            self.cancel.wait(POLL_S)
        self.op.waiting_for = ""


class Operations:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cancel = threading.Event()  # serve was told to stop
        self.current: Operation | None = None
        self.last: Operation | None = None
        self._thread: threading.Thread | None = None

    def start(self, op: Operation) -> Operation:
        """Run the operation on a thread of its own; Refused (409) while another runs, (503) once serve stops."""
        with self._lock:
            if self._cancel.is_set():
                raise Refused(503, "serve is shutting down")
            if self.current is not None:
                raise Refused(409, f"a {self.current.kind} runs ({self.current.description}, operation "
                                   f"{self.current.id}): wait for it to end (GET /admin/status)")
            self.current = op
            log.info("operation %s started: %s (%d steps)", op.id, op.description, len(op.steps))
            self._thread = threading.Thread(target=self._run, args=(op,), name=f"ops-{op.kind}", daemon=True)
            self._thread.start()
        return op

    @property
    def busy(self) -> bool:
        return self.current is not None

    def _run(self, op: Operation) -> None:
        progress = Progress(op, self._cancel)
        try:
            for name, step in op.steps:
                progress.check()
                op.step = name
                log.info("operation %s: step %d/%d: %s", op.id, op.steps_done + 1, len(op.steps), name)
                step(progress)
                op.steps_done += 1
            op.state = "succeeded"
            log.info("operation %s succeeded: %s", op.id, op.description)
        except Cancelled:
            op.state, op.error = "cancelled", "serve was told to stop: the drain took over"
            log.warning("operation %s cancelled at step %r: serve is shutting down", op.id, op.step)
        except StagemeshError as err:
            op.state, op.error = "failed", str(err)
            log.error("operation %s failed at step %r: %s", op.id, op.step, err)
        except Exception as err:  # a bug: the operation stops, serve goes on serving
            op.state, op.error = "failed", f"{type(err).__name__}: {err}"
            log.exception("operation %s failed at step %r", op.id, op.step)
        finally:
            op.finished_at, op.waiting_for = time.time(), ""
            with self._lock:
                self.current, self.last = None, op

    def stop(self, timeout_s: float = 10.0) -> None:
        """serve stops: end the running operation (its waits see it within POLL_S) before the drain."""
        with self._lock:
            self._cancel.set()
            thread = self._thread
        if thread is not None and thread.is_alive():
            log.info("ending the running operation before the drain (at most %.0fs)", timeout_s)
            thread.join(timeout_s)

    def status(self) -> dict:
        current, last = self.current, self.last
        return {"operation": current.to_dict() if current is not None else None,
                "last_operation": last.to_dict() if last is not None else None}
