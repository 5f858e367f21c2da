"""The router continues a request whose replica fails mid-stream on another replica, from the tokens it
streamed (in-process fake replicas: the real processes are in tests/test_recovery.py)."""
from __future__ import annotations

import json

import pytest
import requests

from fake_replicas import FakeRouter
from tiny_models import with_word_tokenizer

M = "fake-model"


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir, tmp_path_factory):
    return with_word_tokenizer(tiny_model_dir("llama"), tmp_path_factory.mktemp("continuation") / "tok")


def stream(base_url: str, body: dict) -> tuple[list[int], str, dict]:
    ids, text, usage = [], "", None
    with requests.post(f"{base_url}/v1/completions", stream=True, timeout=30,
                       json={**body, "stream": True, "stream_options": {"include_usage": True},
                             "return_token_ids": True}) as resp:
        assert resp.status_code == 200, resp.text
        for line in resp.iter_lines():
            if line.startswith(b"data: {"):
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                usage = chunk.get("usage") or usage
                for c in chunk["choices"]:
                    text += c["text"]
                    ids += c.get("token_ids") or []
    return ids, text, usage


def test_a_stream_whose_replica_fails_goes_on_elsewhere_without_gap_or_repeat(model_dir):
    body = {"model": M, "prompt": [5, 6, 7], "max_tokens": 8, "min_tokens": 2}
    with FakeRouter(model_dir, M, num_replicas=2) as router:
        want = stream(router.base_url, body)
        a, b = router.replicas
        a.fail_after = 3
        got = stream(router.base_url, body)
    assert got == want and len(want[0]) == 8
    assert got[2]["prompt_tokens"] == 3 and got[2]["completion_tokens"] == 8
    assert b.generated[-1] == want[0][:3]  # the continuation carried the streamed tokens
    assert b.submitted[-1][2].max_tokens == 8  # max_tokens counts them there


def test_no_continuation_past_max_request_retries(model_dir):
    with FakeRouter(model_dir, M, num_replicas=2, max_request_retries=0) as router:
        router.replicas[0].fail_after = 2
        resp = requests.post(f"{router.base_url}/v1/completions", timeout=30,
                             json={"model": M, "prompt": [5, 6, 7], "max_tokens": 8})
    assert resp.status_code == 503 and "died" in resp.json()["error"]["message"]
    assert router.replicas[1].submitted == []
