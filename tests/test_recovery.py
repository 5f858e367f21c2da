"""Zero lost requests: streams in flight when a stage, or a whole replica's scheduler, is SIGKILLed go on
and end with exactly the tokens they would have had (transformers' greedy tokens; a seeded request's
undisturbed tokens): no error, no gap, no repeat. Real processes on loopback."""
from __future__ import annotations

import json
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from mesh import Mesh, Router, free_port
from parity import prompts
from stagemesh.core.sampling_params import SamplingParams
from stagemesh.v1 import scheduler_pb2
from tiny_models import reference_model, reference_tokens, with_word_tokenizer

pytestmark = pytest.mark.slow
NEW_TOKENS = 40
LENGTHS = (5, 40, 17, 70, 3, 33, 9, 51)
LONG = 120  # tokens per stream across replicas: the kill comes well before the end


def scrape(url: str) -> dict[str, float]:
    lines = requests.get(url, timeout=10).text.splitlines()
    return {k: float(v) for k, v in (line.rsplit(" ", 1) for line in lines if line and not line.startswith("#"))}


def wait_for_steps(mesh: Mesh, steps: int) -> None:
    """Until the replica has run `steps` micro-batches since the call (the streams are under way)."""
    stats = lambda: mesh.stub.GetStats(scheduler_pb2.GetStatsRequest(), timeout=5)  # noqa: E731
    start = stats().num_steps
    deadline = time.monotonic() + 60
    while stats().num_steps < start + steps:
        assert time.monotonic() < deadline, "the streams did not start"
        time.sleep(0.01)


@pytest.mark.parametrize("standby", [False, True], ids=["restarted", "standby"])
def test_a_stage_killed_mid_stream_loses_no_request(tiny_model_dir, tmp_path, standby):
    """16 streams on a PP=2 replica (8 greedy, 8 seeded at temperature 1); stage 1 is SIGKILLed mid-stream
    and restarted with the same command, or a --standby stage takes its place. Restarted, stage 0 is TP=2: its
    follower leaves the broken epoch and joins the next on rank 0's word (stage_worker.control)."""
    model_dir = tiny_model_dir("llama")
    ref = reference_model(model_dir)
    batch = prompts(384, LENGTHS)
    greedy = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    want = [reference_tokens(ref, p, NEW_TOKENS) for p in batch]
    seeded = [SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True, temperature=1.0, seed=100 + i)
              for i in range(len(batch))]
    metrics = free_port()
    with Mesh(model_dir, [2, 2], tp=[1 if standby else 2, 1], handoff="nccl", log_dir=tmp_path,
              scheduler_args=("--stage-recovery-timeout", "90", "--metrics-port", str(metrics))) as mesh:
        undisturbed = mesh.submit_stream([(f"u{i}", p, s) for i, (p, s) in enumerate(zip(batch, seeded))])
        if standby:
            mesh.start_stage(1, standby=True)
            deadline = time.monotonic() + 120
            while "is a spare for stage 1" not in (tmp_path / "scheduler.log").read_text():
                assert time.monotonic() < deadline and mesh.spares[0].poll() is None, "the spare did not register"
                time.sleep(0.2)
        work = [(f"g{i}", p, greedy) for i, p in enumerate(batch)] + \
               [(f"s{i}", p, s) for i, (p, s) in enumerate(zip(batch, seeded))]
        with ThreadPoolExecutor(1) as pool:
            streaming = pool.submit(mesh.submit_stream, work, 240)
            wait_for_steps(mesh, 6)  # prompts computed, a few tokens streamed each
            mesh.kill_stage(1)
            if not standby:
                mesh.start_stage(1)  # the same command
            results = streaming.result(timeout=240)
        scraped = scrape(f"http://127.0.0.1:{metrics}/metrics")
    assert scraped["stagemesh:num_requests_recovered_total"] == 16
    assert scraped["stagemesh:request_recovery_stall_seconds_count"] == 16
    for i in range(len(batch)):
        assert results[f"g{i}"] == (want[i], "length"), f"greedy stream {i}"
        assert results[f"s{i}"] == undisturbed[f"u{i}"], f"seeded stream {i}"
    log = (tmp_path / "scheduler.log").read_text()
    kept = int(re.search(r"keeping (\d+) request\(s\)", log).group(1))
    assert kept == 16, "every stream was in flight when the stage died"
    assert len(re.findall(r"request [gs]\d+ recovered after a [\d.]+s stall", log)) == 16
    if standby:
        assert "the spare stage 1" in log and "takes its place" in log


def sse(base_url: str, body: dict, first: threading.Barrier | None = None) -> tuple[str, dict | None]:
    """A streamed completion: (its text, its usage); waits at `first` after its first text."""
    text, usage = "", None
    with requests.post(f"{base_url}/v1/completions", json={**body, "stream": True,
                                                            "stream_options": {"include_usage": True}},
                       stream=True, timeout=240) as resp:
        assert resp.status_code == 200, resp.text
        for line in resp.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk["choices"]:
                text += choice["text"]
                if choice["text"] and first is not None:
                    first.wait(timeout=120)
                    first = None
    return text, usage


def test_a_replica_whose_scheduler_dies_mid_stream_hands_its_streams_to_the_other(tiny_model_dir, tmp_path):
    """DP=2 behind the router: 16 streams (8 greedy, 8 seeded), each past its first token, when one replica's
    scheduler is SIGKILLed: every stream ends with the text of an undisturbed run, usage counted once."""
    model_dir = with_word_tokenizer(tiny_model_dir("llama"), tmp_path / "model")
    batch = prompts(384, LENGTHS)
    bodies = [{"model": "m", "prompt": p, "max_tokens": LONG, "ignore_eos": True,
               **({"temperature": 0} if k == 0 else {"temperature": 1.0, "seed": 7 + i})}
              for k in (0, 1) for i, p in enumerate(batch)]
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    with Mesh(model_dir, [4], log_dir=tmp_path / "a") as a, Mesh(model_dir, [4], log_dir=tmp_path / "b") as b:
        with Router(model_dir, [a.address, b.address], ("--served-model-name", "m", "--policy", "round-robin"),
                    log_dir=tmp_path) as router:
            with ThreadPoolExecutor(len(bodies)) as pool:
                undisturbed = list(pool.map(lambda body: sse(router.base_url, body), bodies))
                first = threading.Barrier(len(bodies) + 1)
                streams = [pool.submit(sse, router.base_url, body, first) for body in bodies]
                first.wait(timeout=120)  # every stream has text: half of them on b
                b.kill_scheduler()
                disturbed = [s.result(timeout=240) for s in streams]
            scraped = scrape(f"{router.base_url}/metrics")
    assert scraped['stagemesh:router_request_replays_total{kind="continuation"}'] == 8
    for i, ((text, usage), (want_text, _)) in enumerate(zip(disturbed, undisturbed)):
        assert text == want_text, f"stream {i}"
        assert usage["prompt_tokens"] == len(bodies[i]["prompt"]) and usage["completion_tokens"] == LONG
    log = (tmp_path / f"router-{router.port}.log").read_text()
    moved = re.findall(r"replica 127\.0\.0\.1:\d+ failed after (\d+) token\(s\)", log)
    assert len(moved) == 8 and all(int(n) > 0 for n in moved), log[-3000:]
