"""vLLM's start-up contract through `stagemesh serve`: a script that waits for /health to say 200 and then sends
at once gets its answer (`until curl -sf localhost:8000/health; do sleep 1; done`, then the first request), on
one stage and on -tp 2 -pp 2; every replica warms up before it says it serves (with --skip-server-warmup none does,
and the first request is answered all the same). A router started on its own keeps
/health as liveness (tests/test_deploy.py)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import requests

from mesh import free_port, start_serve
from stagemesh.core.common_flags import SKIP_WARMUP_ENV

pytestmark = pytest.mark.slow


def wait_for_health(proc: subprocess.Popen, base: str, timeout_s: float = 240) -> list[int]:
    """The vLLM-style loop: /health until 200, connection errors and 503 allowed; the statuses seen."""
    seen: list[int] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, "serve exited during start-up"
        try:
            seen.append(requests.get(f"{base}/health", timeout=2).status_code)
            if seen[-1] == 200:
                return seen
        except requests.ConnectionError:
            pass
        time.sleep(0.05)
    pytest.fail(f"/health never said 200 in {timeout_s}s (statuses seen: {sorted(set(seen))})")


@pytest.mark.parametrize("layout", ["default-1-stage", "wide-tp2-pp2", "default-skip-server-warmup"])
def test_a_vllm_style_start_up_script_gets_an_answer_to_its_first_request(layout, default_model_dir,
                                                                            wide_model_dir, tmp_path):
    model, extra = ((wide_model_dir, ("-tp", "2", "-pp", "2", "--handoff", "grpc")) if layout == "wide-tp2-pp2" else
                    (default_model_dir, ()))
    warm = layout != "default-skip-server-warmup"  # (skipped by the flag: the environment says warm up)
    port, log_path = free_port(), tmp_path / "serve.log"
    argv = [str(model), "--port", str(port), "--threads", "1", *([] if warm else ["--skip-server-warmup"]), *extra]
    if layout == "default-1-stage":  # as a user starts it: a cold interpreter, whose children spawn cold
        with open(log_path, "wb") as log:
            proc = subprocess.Popen([sys.executable, "-m", "stagemesh", "serve", *argv], stdout=log,
                                    stderr=subprocess.STDOUT, env={**os.environ, SKIP_WARMUP_ENV: "0"})
    else:  # the same contract, forked warm (the order of start-up does not depend on how a process starts)
        proc = start_serve(argv, log_path, {SKIP_WARMUP_ENV: "0"})
    base = f"http://127.0.0.1:{port}"
    prompt = "w5 w6 w7" if layout == "wide-tp2-pp2" else "The capital of France is"
    try:
        wait_for_health(proc, base)
        first = requests.post(f"{base}/v1/completions", timeout=60, json={
            "model": requests.get(f"{base}/v1/models", timeout=5).json()["data"][0]["id"],
            "prompt": prompt, "max_tokens": 4, "temperature": 0})
        assert first.status_code == 200, (first.text, log_path.read_text()[-3000:])
        assert first.json()["usage"]["completion_tokens"] == 4
        text = log_path.read_text()
        if not warm:  # serve passed the flag on: the scheduler ran no warm-up, and the answer came all the same
            assert "warm-up: " not in text and "pipeline formed" in text, text[-3000:]
        else:
            assert "warm-up: " in text and "before serving" in text, text[-3000:]
            # the warm-up ran before the replica said it serves, and the router listened only after that
            assert text.index("warm-up: ") < text.index("pipeline formed") < text.index("router serving")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
