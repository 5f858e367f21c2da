"""The stage's torch work on the process's main thread.

gRPC calls arrive on the server's pool threads, but on CPU every thread that enters an OpenMP
parallel region keeps its own team of worker threads, and once a process has more such threads
than cores, libgomp stops spinning between regions (each of the ~250 parallel ops of a decode step
then pays a futex wake-up). Measured on 2 cores, batch-1 decode of the default model at 2 threads:
35 ms per token on the main thread, 50-60 ms on any other thread, 73-88 ms on the main thread while
another thread that ran one parallel op stays alive. So every step, and the KV cache allocation,
runs here, on the one thread that loaded the model.
"""
from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from typing import Callable, TypeVar

from stagemesh.core.errors import StagemeshError

T = TypeVar("T")


class MainLoop:
    """Runs submitted calls on the thread that calls `run_until`. Before `start` (or after the loop ends) a
    call runs on the caller's thread; between `start` and `run_until` calls wait for the loop."""

    def __init__(self) -> None:
        # queue.Queue, not SimpleQueue: on Python 3.11 a SimpleQueue.get(timeout) that a signal handler (the
        # drain's SIGTERM, on this main thread) outlasts waits for ever, and the stage never sees its stop
        self._queue: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._running = False

    def call(self, fn: Callable[..., T], *args) -> T:
        return self.submit(fn, *args).result()

    def submit(self, fn: Callable[..., T], *args) -> Future:
        """Queue the call (calls run in the order they were submitted); before `start`, run it now."""
        future: Future = Future()
        with self._lock:
            if self._running:
                self._queue.put((future, fn, args))
                return future
        try:
            future.set_result(fn(*args))
        except BaseException as err:  # noqa: BLE001 - raised by result(), as from the loop
            future.set_exception(err)
        return future

    def start(self) -> None:
        with self._lock:
            self._running = True

    def run_until(self, stop: threading.Event, poll_s: float = 0.2, idle=None) -> None:
        """Run calls until `stop` is set. `idle` (a stage_worker.ep_group.EPGroup): when no call came within
        its `idle_wait`, its `idle_tick()` runs (its errors end the loop)."""
        self.start()
        ended_by: BaseException = StagemeshError("the stage is stopping")
        try:
            while not stop.is_set():
                try:
                    future, fn, args = self._queue.get(timeout=poll_s if idle is None else idle.idle_wait)
                except queue.Empty:
                    if idle is not None:
                        try:
                            idle.idle_tick()
                        except BaseException as err:  # the calls still queued fail with the reason too
                            ended_by = err
                            raise
                    continue
                # a call runs even if its caller gave up waiting (a cancelled RPC): a step that took its
                # place in the order must run, or the stages' states would part
                future.set_running_or_notify_cancel()
                try:
                    result = fn(*args)
                except BaseException as err:  # noqa: BLE001 - handed to the caller, which reports it
                    if not future.cancelled():
                        future.set_exception(err)
                else:
                    if not future.cancelled():
                        future.set_result(result)
        finally:
            with self._lock:
                self._running = False
            while True:
                try:
                    future, _, _ = self._queue.get_nowait()
                except queue.Empty:
                    break
                if future.set_running_or_notify_cancel():
                    future.set_exception(ended_by)
