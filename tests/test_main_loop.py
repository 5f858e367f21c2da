"""The stage's main loop: model work handed over from gRPC threads runs on the loop's thread."""
from __future__ import annotations

import threading
import time

import pytest

from stage_worker.main_loop import MainLoop
from stagemesh.core.errors import StagemeshError


def test_calls_from_other_threads_run_on_the_loop_thread_and_errors_reach_the_caller():
    loop, stop = MainLoop(), threading.Event()
    results, errors = [], []

    def client(i: int) -> None:
        try:
            results.append((i, loop.call(threading.get_ident)))
            loop.call(lambda: 1 / 0)
        except ZeroDivisionError as err:
            errors.append(err)

    loop.start()
    clients = [threading.Thread(target=client, args=(i,)) for i in range(4)]
    for t in clients:
        t.start()
    runner = threading.Thread(target=loop.run_until, args=(stop, 0.01))
    runner.start()
    for t in clients:
        t.join(timeout=30)
    stop.set()
    runner.join(timeout=30)
    assert sorted(i for i, _ in results) == [0, 1, 2, 3]
    assert {ident for _, ident in results} == {runner.ident}
    assert len(errors) == 4


def test_before_start_a_call_runs_inline_and_a_stopped_loop_fails_what_waits():
    loop, stop = MainLoop(), threading.Event()
    assert loop.call(threading.get_ident) == threading.get_ident()
    loop.start()
    outcome = []
    waiter = threading.Thread(target=lambda: outcome.append(pytest.raises(StagemeshError, loop.call, int)))
    waiter.start()
    while loop._queue.empty():  # the call is queued
        time.sleep(0.001)
    stop.set()
    loop.run_until(stop)  # stops at once: the waiting call is failed, not left hanging
    waiter.join(timeout=30)
    assert not waiter.is_alive() and "stopping" in str(outcome[0].value)


def test_a_call_whose_caller_gave_up_still_runs_and_the_loop_goes_on():
    loop, stop = MainLoop(), threading.Event()
    loop.start()
    ran = []
    slow = loop.submit(lambda: (time.sleep(0.2), ran.append("slow")))
    cancelled = loop.submit(lambda: ran.append("cancelled call"))
    assert cancelled.cancel()  # its caller went away before it ran (a cancelled RPC)
    slow_running = threading.Thread(target=loop.run_until, args=(stop, 0.01))
    slow_running.start()
    try:
        slow.result(timeout=5)
        assert loop.call(threading.get_ident) == slow_running.ident  # the loop thread still serves
        assert ran == ["slow", "cancelled call"]  # it ran anyway: its place in the order was taken
    finally:
        stop.set()
        slow_running.join(timeout=5)
    assert not slow_running.is_alive()


def test_a_signal_handler_that_outlasts_the_poll_does_not_hang_the_loop():
    """A stage's SIGTERM handler runs on the main thread, inside the loop's wait for a call. On Python 3.11 a
    SimpleQueue.get(timeout) that the handler outlasts waits for ever (a stage that never saw its stop, under
    test_drain): the loop must still see its stop. In a child process, so that a hang is bounded."""
    import subprocess
    import sys

    code = """if True:
        import signal, threading, time
        from stage_worker.main_loop import MainLoop
        stop = threading.Event()
        def handler(signum, frame):
            time.sleep(0.3)  # longer than what is left of the loop's poll
            stop.set()
        signal.signal(signal.SIGALRM, handler)
        signal.setitimer(signal.ITIMER_REAL, 0.1)
        MainLoop().run_until(stop, poll_s=0.2)
        print("stopped")
    """
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "stopped", done.stderr
