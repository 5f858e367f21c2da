"""--scheduling-policy priority through the gateway (vLLM's `priority` field): a real replica whose KV cache
holds 80 tokens, two long low-priority streams, and a high-priority request that comes after them."""
from __future__ import annotations

import threading
import time

import pytest
import requests

from mesh import Mesh, Router
from parity import prompts
from stagemesh.client import Client
from tiny_models import reference_model, reference_tokens, with_word_tokenizer

pytestmark = pytest.mark.slow
M = "llama-tiny"
NEW_TOKENS = 48  # with a 16-token prompt: 4 of the cache's 5 blocks of 16 tokens per request


@pytest.fixture(scope="module")
def router(tiny_model_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("priority")
    model = with_word_tokenizer(tiny_model_dir("llama"), logs / "model")
    with Mesh(model, [4], scheduler_args=("--scheduling-policy", "priority"),
              stage_args=("--kv-cache-memory", "90112"), log_dir=logs) as mesh:
        with Router(model, [mesh.address], ("--served-model-name", M), log_dir=logs, grpc_frontend=True) as r:
            r.logs, r.model = logs, model
            yield r


def stream(router, prompt: list[int], priority: int, first_token: threading.Event, out: dict) -> None:
    ids = []
    for chunk in router.client().completions.create(model=M, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0,
                                                    stream=True, extra_body={"ignore_eos": True, "priority": priority,
                                                                             "return_token_ids": True}):
        ids += chunk.choices[0].model_extra.get("token_ids") or []
        first_token.set()
    out.update(ids=ids, done=time.monotonic())


def stream_grpc(router, prompt: list[int], priority: int, first_token: threading.Event, out: dict) -> None:
    """As stream(), through the gRPC frontend (stagemesh.client), which takes the same priority."""
    ids = []
    with Client(f"127.0.0.1:{router.grpc_port}") as client:
        for reply in client.generate(prompt, max_tokens=NEW_TOKENS, stream=True, ignore_eos=True, priority=priority):
            ids += reply.token_ids
            first_token.set()
    out.update(ids=ids, done=time.monotonic())


@pytest.mark.parametrize("door", ["http", "grpc"])
def test_a_later_high_priority_request_preempts_the_low_ones_and_every_answer_is_exact(router, door):
    assert "KV cache size: 80 tokens" in (router.logs / "scheduler.log").read_text()
    low_a, low_b, high = prompts(384, (16, 16, 16), seed=3)
    reference = reference_model(router.model)
    want = [reference_tokens(reference, p, NEW_TOKENS) for p in (low_a, low_b, high)]
    results = [{}, {}, {}]
    started = [threading.Event() for _ in range(3)]
    threads = [threading.Thread(target=stream, args=(router, p, prio, ev, out))
               for p, prio, ev, out in zip((low_a, low_b), (10, 10), started, results)]
    for t in threads:
        t.start()
    for ev in started[:2]:
        assert ev.wait(120)
    # both low streams run and fill the cache; the high one (lower value: served first) comes now
    high_stream = stream if door == "http" else stream_grpc
    threads.append(threading.Thread(target=high_stream, args=(router, high, -5, started[2], results[2])))
    threads[-1].start()
    for t in threads:
        t.join(300)
    assert [r["ids"] for r in results] == want  # preempted and recomputed, every stream has its exact tokens
    a, b, h = (r["done"] for r in results)
    # The cache holds one low stream whole beside the high one, not two: first come, first served, the high one
    # would wait for both and end last. Priority runs it ahead of the low one that waits for blocks; the other
    # may still end first, when the blocks it held sufficed to its end (how far it got before the high one came
    # is the machine's timing).
    assert h < max(a, b), "the high-priority request came last: it waited behind both low ones"
    metrics = requests.get(f"{router.base_url}/metrics", timeout=10).text
    preempted = sum(float(line.split()[-1]) for line in metrics.splitlines()
                    if line.startswith("vllm:num_preemptions_total{"))
    assert preempted > 0


def test_priority_must_be_an_integer_of_32_bits(router):
    for value, words in ((2**31, "'priority' must be a 32-bit integer"), ("1", "'priority' must be an integer")):
        resp = requests.post(f"{router.base_url}/v1/completions",
                             json={"model": M, "prompt": [5, 6], "max_tokens": 2, "priority": value}, timeout=30)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "priority", resp.text
        assert words in resp.json()["error"]["message"]
    resp = requests.post(f"{router.base_url}/v1/chat/completions", timeout=60, json={
        "model": M, "messages": [{"role": "user", "content": "w5 w6"}], "max_tokens": 2, "priority": -3})
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] >= 1
