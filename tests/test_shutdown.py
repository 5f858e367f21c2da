"""A process told to stop exits whatever its drain thread does: the second signal, or the drain's time running
out, stops its main loop (stagemesh.core.shutdown's `force_stop`, as a stage installs it)."""
from __future__ import annotations

import logging
import os
import signal
import threading
import time

import pytest

from stagemesh.core import shutdown as shutdown_mod
from stagemesh.core.shutdown import Shutdown
from stage_worker.main_loop import MainLoop

log = logging.getLogger("test")


def _serve(stop: threading.Event) -> threading.Thread:
    """A stage's main loop, with no drain thread at all (the case a lost register thread leaves)."""
    loop = MainLoop()
    loop.start()
    thread = threading.Thread(target=loop.run_until, args=(stop,), kwargs={"poll_s": 0.02}, daemon=True)
    thread.start()
    return thread


def test_a_second_signal_stops_the_main_loop_itself():
    stop = threading.Event()
    down = Shutdown(600, log, "stage 0", force_stop=stop.set)
    thread = _serve(stop)
    down.signal()
    thread.join(0.3)
    assert thread.is_alive(), "the first signal only starts the drain"
    down.signal()
    thread.join(5)
    assert not thread.is_alive() and down.hurry.is_set()


def test_the_drain_running_out_of_time_stops_the_main_loop(monkeypatch):
    monkeypatch.setattr(shutdown_mod, "FORCE_SLACK_S", 0.1)
    stop = threading.Event()
    down = Shutdown(0.2, log, "stage 0", force_stop=stop.set)
    thread = _serve(stop)
    started = time.monotonic()
    down.signal()
    thread.join(10)
    assert not thread.is_alive()
    assert time.monotonic() - started >= 0.3 - 0.05  # not before --shutdown-timeout and its slack


def test_without_force_stop_a_signal_only_sets_the_events():
    down = Shutdown(0.01, log, "router")
    down.signal()
    down.signal()
    assert down.requested.is_set() and down.hurry.is_set()


def test_a_stage_that_stops_wakes_a_step_waiting_on_another_stage():
    """The first stage of a drained replica may be running a step ahead whose tokens the last stage, stopped
    first, never sends: its stop (stage_worker.cli.StageStop) aborts the handoff, so the main loop ends at once
    instead of after the handoff's 120 s wait (a stage that outlived its serve under test_drain)."""
    import torch

    from stage_worker.cli import StageStop
    from stage_worker.handoff import GrpcHandoff, HandoffAborted

    handoff = GrpcHandoff(None, torch.device("cpu"), epoch=1)
    stop = StageStop()
    stop.on_set.append(handoff.abort)
    loop = MainLoop()
    loop.start()
    thread = threading.Thread(target=loop.run_until, args=(stop,), kwargs={"poll_s": 0.02}, daemon=True)
    thread.start()
    step = loop.submit(handoff.recv_tokens, 3, 2)  # a step ahead, waiting for the last stage's tokens
    time.sleep(0.2)
    assert not step.done()
    started = time.monotonic()
    stop.set()
    thread.join(5)
    assert not thread.is_alive() and time.monotonic() - started < 5
    assert isinstance(step.exception(timeout=1), HandoffAborted)


@pytest.fixture
def saved_signal_handlers():
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


def test_a_signal_during_a_stages_start_up_exits_0_whatever_the_interrupted_code_made_of_it(saved_signal_handlers):
    """SIGTERM while a stage starts raises SystemExit wherever it loads; an import it interrupts may turn that
    into another error (numpy: "cannot load module more than once per process", a Traceback test_drain met).
    The stage exits 0 all the same; an error with no signal behind it still propagates."""
    from stage_worker.cli import StartingStop

    def loading() -> int:
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler raises here
        except SystemExit:
            raise ImportError("cannot load module more than once per process") from None
        return 1

    starting = StartingStop().install()
    started = time.monotonic()
    assert starting.call(loading) == 0 and starting.signum == signal.SIGTERM
    assert time.monotonic() - started < 5

    def broken() -> int:
        raise ImportError("a real one")

    with pytest.raises(ImportError, match="a real one"):
        StartingStop().install().call(broken)
