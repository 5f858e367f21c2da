"""Runtime scaling of a real `stagemesh serve`: 1 -> 2 -> 1 replicas under 8 looping streams (the scale-in's
scheduler SIGKILLed mid-drain: its streams go on elsewhere), every answer token-exact and none lost; the admin
API's refusals (no key 401, a wrong key 403, 0 replicas 400, a one-replica rollout without --surge 400, a second
operation 409); SIGTERM during a scale-out: the drain wins, serve exits 0 and no child is left. And the
autoscaler: a burst grows the mesh to 2 replicas, the quiet after shrinks it back."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from ops_mesh import Load, Serve, scrape
from parity import prompts
from tiny_models import greedy_tokens, with_word_tokenizer

pytestmark = pytest.mark.slow
NEW_TOKENS = 64


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir, tmp_path_factory):
    return with_word_tokenizer(tiny_model_dir("llama"), tmp_path_factory.mktemp("scaling") / "model")


@pytest.fixture(scope="module")
def expected(model_dir):
    batch = prompts(384, (5, 40, 17, 70, 3, 33, 9, 51))
    return batch, greedy_tokens(model_dir, batch, NEW_TOKENS)


def test_scale_out_and_in_under_load_loses_nothing(model_dir, expected, tmp_path):
    batch, want = expected
    with Serve(model_dir, tmp_path, "--shutdown-timeout", "20") as serve:
        serve.wait_ready(1)
        _refusals(serve)
        with Load([serve.base_url], str(model_dir), batch, want, NEW_TOKENS, clients=8) as load:
            load.wait_answers(4)
            scaled = subprocess.run([sys.executable, "-m", "stagemesh", "scale", "--data-parallel-size", "2"],
                                    env=serve.env, capture_output=True, text=True, timeout=240)
            assert scaled.returncode == 0, scaled.stdout + scaled.stderr + serve.text()[-3000:]
            assert "succeeded" in scaled.stdout
            serve.wait_ready(2, timeout=30)
            before = len(load.answers)
            load.wait_answers(before + 16)  # both replicas serve
            op = serve.call("POST", "/admin/scale", {"data_parallel_size": 1}).json()["operation"]
            assert serve.call("POST", "/admin/rollout", {"surge": True}).status_code == 409
            # the replica drains: its scheduler dies under its streams, which go on on replica 0
            serve.wait_operation(op["id"], until=lambda o: "scheduler[1] to drain" in (o["waiting_for"] or ""))
            os.kill(serve.pid("scheduler[1]"), 9)
            assert serve.wait_operation(op["id"])["state"] == "succeeded"
            serve.wait_ready(1, timeout=30)
            load.wait_answers(len(load.answers) + 8)
        answered = load.check()
        log = serve.text()
        assert answered >= 28
        metrics = scrape(serve.base_url)
        assert sum(v for k, v in metrics.items() if k.startswith("vllm:request_success_total")
                   and 'engine="1"' in k) > 0, "the added replica served no request"
        # the SIGKILL cut the streams still running there, if the drain had not finished them first (a race the
        # test does not steer: short requests often end before it): either way every answer is token-exact
        # (load.check above); tests/test_drain.py hands streams over on purpose
        print("streams continued elsewhere after the SIGKILL:", len(re.findall(r"continuing it on another replica",
                                                                             log)))
        # SIGTERM while a replica is being added: the drain wins
        op = serve.call("POST", "/admin/scale", {"data_parallel_size": 2}).json()["operation"]
        serve.wait_operation(op["id"], until=lambda o: "form its pipeline" in (o["waiting_for"] or ""))
        serve.stop()
    assert "cancelled at step" in serve.text()


def _refusals(serve: Serve) -> None:
    assert serve.call("GET", "/admin/status", key="").status_code == 401
    assert serve.call("GET", "/admin/status", key="not-the-key").status_code == 403
    assert serve.call("POST", "/admin/scale", {"data_parallel_size": 2}, key="not-the-key").status_code == 403
    zero = serve.call("POST", "/admin/scale", {"data_parallel_size": 0})
    assert zero.status_code == 400 and "at least one replica" in zero.json()["error"]["message"]
    single = serve.call("POST", "/admin/rollout", {})
    assert single.status_code == 400 and "--surge" in single.json()["error"]["message"]
    same = serve.call("POST", "/admin/scale", {"data_parallel_size": 1})
    assert same.status_code == 200 and same.json()["operation"] is None
    status = serve.call("GET", "/admin/status").json()
    assert status["backend"] == "mp" and status["data_parallel_size"] == 1 and status["operation"] is None
    assert serve.admin()[1] not in serve.text()  # the key is never logged


def test_the_autoscaler_grows_under_a_burst_and_shrinks_after(model_dir, expected, tmp_path):
    batch, want = expected
    flags = ("--max-num-seqs", "2", "--autoscale-max-replicas", "2", "--autoscale-target-waiting", "1",
             "--autoscale-scale-up-window", "1", "--autoscale-scale-down-window", "3", "--autoscale-cooldown", "2",
             "--autoscale-interval", "0.5", "--shutdown-timeout", "5")
    with Serve(model_dir, tmp_path, *flags) as serve:
        serve.wait_ready(1)

        def one(i: int) -> list[int]:
            body = {"model": str(model_dir), "prompt": batch[i % 8], "max_tokens": NEW_TOKENS, "temperature": 0,
                    "ignore_eos": True, "return_token_ids": True}
            resp = requests.post(f"{serve.base_url}/v1/completions", json=body, timeout=180)
            assert resp.status_code == 200, resp.text
            return resp.json()["choices"][0]["token_ids"]

        with ThreadPoolExecutor(12) as pool:  # 12 at once over 2 seats: 10 wait
            burst = [pool.submit(one, i) for i in range(48)]
            deadline = time.monotonic() + 120
            while "autoscaler: scaling from 1 to 2" not in serve.text():
                assert time.monotonic() < deadline, serve.text()[-3000:]
                time.sleep(0.2)
            got = [f.result(timeout=240) for f in burst]
        assert got == [want[i % 8] for i in range(48)]
        deadline = time.monotonic() + 120
        while "autoscaler: scaling from 2 to 1" not in serve.text():
            assert time.monotonic() < deadline, serve.text()[-3000:]
            time.sleep(0.2)
        serve.wait_ready(1, timeout=60)
        status = serve.call("GET", "/admin/status").json()
        assert status["autoscale"]["max_replicas"] == 2 and "2 -> 1" in status["autoscale"]["last_decision"]
    log = serve.text()
    assert re.search(r"autoscaler: scaling from 1 to 2 replica\(s\): [\d.]+ request\(s\) waiting per replica", log)
    assert re.search(r"autoscaler: scaling from 2 to 1 replica\(s\): .*one replica fewer would stay under", log)
