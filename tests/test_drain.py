"""SIGTERM drains: `stagemesh serve` told to stop under 8 streams lets them finish token-exact (its router's
readiness false meanwhile) and exits 0 with no child left; a second signal ends the drain at once; a signal
during start-up stops the mesh cleanly; a scheduler that drains hands the requests it could not finish in time
back to the router, which continues them token-exact on another replica. Real processes on loopback."""
from __future__ import annotations

import re
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from mesh import Mesh, Router
from parity import prompts
from sse_client import stream
from test_serve import alive, serving, wait_for
from tiny_models import greedy_tokens

pytestmark = pytest.mark.slow
NEW_TOKENS = 48


def _body(prompt: list[int], max_tokens: int = NEW_TOKENS) -> dict:
    return {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "return_token_ids": True}


def _started(log_path) -> tuple[str, list[int]]:
    """(the router's base URL, every child's pid) once serve's router is ready."""
    port = wait_for(log_path, r"router serving \S+ on http://127\.0\.0\.1:(\d+)").group(1)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while requests.get(f"{base}/ready", timeout=5).status_code != 200:
        assert time.monotonic() < deadline, "the router never became ready"
        time.sleep(0.2)
    return base, [int(p) for p in re.findall(r"started \S+ \(pid (\d+)\)", log_path.read_text())]


def test_sigterm_under_8_streams_lets_them_finish_and_exits_0(wide_model_dir, tmp_path):
    batch = prompts(384, (5, 40, 17, 70, 3, 33, 9, 51))
    want = greedy_tokens(wide_model_dir, batch, NEW_TOKENS)
    log_path = tmp_path / "serve.log"
    with serving(wide_model_dir, log_path, "--served-model-name", "m", "--shutdown-timeout", "60") as proc:
        base, pids = _started(log_path)
        progress, lock = {}, threading.Lock()

        def one(i: int):
            def seen(out):
                with lock:
                    progress[i] = len(out.token_ids)
            return stream([base], "/v1/completions", _body(batch[i]), f"d{i}", on_event=seen, max_resumes=0)

        session = requests.Session()
        assert session.get(f"{base}/ready", timeout=5).status_code == 200  # (a kept-alive connection)
        with ThreadPoolExecutor(8) as pool:
            streams = [pool.submit(one, i) for i in range(8)]
            while sum(v >= 2 for v in progress.values()) < 8:
                time.sleep(0.01)
            proc.send_signal(signal.SIGTERM)
            readiness = []
            while not all(s.done() for s in streams):
                try:
                    readiness.append(session.get(f"{base}/ready", timeout=5).status_code)
                except requests.ConnectionError:
                    readiness.append("closed")
                time.sleep(0.05)
            results = [s.result() for s in streams]
        assert proc.wait(timeout=60) == 0
        assert 503 in readiness, readiness  # readiness turned false while the streams finished
        for i, got in enumerate(results):
            assert got.done and got.token_ids == want[i] and got.finish_reasons == ["length"], f"stream {i}"
        assert [p for p in pids if alive(p)] == []
        log = log_path.read_text()
        assert "drained the routers" in log and "router: drained" in log
        with pytest.raises(requests.ConnectionError):  # nothing listens any more
            requests.get(f"{base}/health", timeout=2)


def test_a_second_signal_ends_the_drain_at_once(wide_model_dir, tmp_path):
    log_path = tmp_path / "serve.log"
    with serving(wide_model_dir, log_path, "--served-model-name", "m", "--shutdown-timeout", "120") as proc:
        base, pids = _started(log_path)
        with ThreadPoolExecutor(1) as pool:
            long = pool.submit(requests.post, f"{base}/v1/completions", json=_body([5, 6, 7], 480), timeout=60)
            time.sleep(0.5)
            proc.send_signal(signal.SIGTERM)
            wait_for(log_path, r"router: signal 15: draining")
            start = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=30) == 0
            assert time.monotonic() - start < 20  # not the 120 s drain
            long.exception(timeout=30)
        log = log_path.read_text()
        assert "second signal: ending the drain now" in log
        assert [p for p in pids if alive(p)] == []


def test_a_signal_during_start_up_stops_the_mesh_cleanly(wide_model_dir, tmp_path):
    log_path = tmp_path / "serve.log"
    with serving(wide_model_dir, log_path) as proc:
        wait_for(log_path, r"started stage\[0\.1\]")  # the stages load their weights now
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        pids = [int(p) for p in re.findall(r"started \S+ \(pid (\d+)\)", log_path.read_text())]
        assert pids and [p for p in pids if alive(p)] == []
        assert "Traceback" not in log_path.read_text()


def test_a_draining_scheduler_hands_what_it_could_not_finish_to_another_replica(wide_model_dir, tmp_path):
    """Replica A's scheduler is told to stop with a 1 s drain: its streams are handed back to the router at the
    end of it and go on, token-exact, on replica B; new requests meanwhile go to B only."""
    batch = prompts(384, (5, 3, 9, 17))
    long = 400  # far more than a 1 s drain finishes
    want = greedy_tokens(wide_model_dir, batch, long)
    args = ("--shutdown-timeout", "1", "--served-model-name", "m")
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    with Mesh(wide_model_dir, [2, 2], log_dir=tmp_path / "a", scheduler_args=args) as a, \
            Mesh(wide_model_dir, [2, 2], log_dir=tmp_path / "b", scheduler_args=args) as b, \
            Router(wide_model_dir, [a.address, b.address], ("--policy", "round-robin"), log_dir=tmp_path) as router:
        progress = {}

        def one(i: int):
            def seen(out):
                progress[i] = len(out.token_ids)
            return stream([router.base_url], "/v1/completions", _body(batch[i], long), f"s{i}", on_event=seen)

        with ThreadPoolExecutor(4) as pool:
            streams = [pool.submit(one, i) for i in range(4)]
            while sum(v >= 5 for v in progress.values()) < 4:
                time.sleep(0.01)
            a.scheduler.send_signal(signal.SIGTERM)
            assert a.scheduler.wait(timeout=30) == 0
            results = [s.result(timeout=120) for s in streams]
            fresh = stream([router.base_url], "/v1/completions", _body(batch[0], 8), "after")
    for i, got in enumerate(results):
        assert got.done and got.resumes == 0 and got.token_ids == want[i], f"stream {i}"
    assert fresh.token_ids == want[0][:8]
    sched_log = (tmp_path / "a" / "scheduler.log").read_text()
    moved = re.search(r"(\d+) request\(s\) handed back", sched_log)
    assert moved and int(moved.group(1)) >= 1, sched_log[-2000:]  # the drain ended with streams still running
