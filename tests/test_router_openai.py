"""The official openai client against the gateway, over a real PP=2 mesh of the default model."""
from __future__ import annotations

import requests
import pytest

from mesh import Mesh, Router

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def router(default_model_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("router-openai")
    with Mesh(default_model_dir, [15, 15], handoff="nccl", log_dir=logs) as mesh:
        with Router(default_model_dir, [mesh.address], log_dir=logs) as r:
            yield r


def test_chat_names_paris(router):
    out = router.client().chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=30, temperature=0)
    assert "Paris" in out.choices[0].message.content
    assert out.choices[0].finish_reason == "stop"
    assert out.usage.completion_tokens > 0 and out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


def test_streaming_chat_equals_the_whole_answer(router):
    client = router.client()
    whole = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=30, temperature=0)
    chunks = list(client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=30, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_completions_with_token_ids_logprobs_and_length(router):
    client = router.client()
    prompt = requests.post(f"{router.base_url}/tokenize", json={"prompt": "The capital of France is"}, timeout=10).json()
    out = client.completions.create(model=MODEL, prompt=prompt["tokens"], max_tokens=5, temperature=0, logprobs=2,
                                    extra_body={"return_token_ids": True})
    choice = out.choices[0]
    assert choice.finish_reason == "length" and len(choice.model_extra["token_ids"]) == 5
    assert len(choice.logprobs.tokens) == 5 and all(len(t) == 2 for t in choice.logprobs.top_logprobs)
    detok = requests.post(f"{router.base_url}/detokenize", json={"tokens": choice.model_extra["token_ids"]}, timeout=10)
    assert detok.json()["prompt"] == choice.text


def test_stop_strings_never_leak(router):
    client = router.client()
    free = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=12, temperature=0)
    word = free.choices[0].text.split()[1]  # a word in the middle of the free answer
    for stream in (False, True):
        out = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=12, temperature=0,
                                        stop=[word], stream=stream)
        text = "".join(c.choices[0].text for c in out) if stream else out.choices[0].text
        assert word not in text and free.choices[0].text.startswith(text)


def test_seeded_sampling_repeats(router):
    client = router.client()
    ask = dict(model=MODEL, messages=QUESTION, max_tokens=12, temperature=1.0, seed=7)
    first = client.chat.completions.create(**ask).choices[0].message.content
    assert client.chat.completions.create(**ask).choices[0].message.content == first


def test_models_health_and_tokenize(router):
    client = router.client()
    assert [m.id for m in client.models.list()] == [MODEL]
    health = requests.get(f"{router.base_url}/health", timeout=5)
    assert health.status_code == 200 and health.json()["replicas"][0]["healthy"] is True
