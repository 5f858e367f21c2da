"""The official openai client against the gateway, over a real PP=2 mesh of the default model."""
from __future__ import annotations

import asyncio
import time

import pytest
import requests

from mesh import Mesh, Router
from stagemesh.v1 import scheduler_pb2

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def router(default_model_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("router-openai")
    with Mesh(default_model_dir, [15, 15], handoff="nccl", log_dir=logs) as mesh:
        with Router(default_model_dir, [mesh.address], log_dir=logs, grpc_frontend=True) as r:
            r.mesh = mesh
            yield r


def test_chat_names_paris(router):
    out = router.client().chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=30, temperature=0)
    assert "Paris" in out.choices[0].message.content
    assert out.choices[0].finish_reason == "stop"
    assert out.usage.completion_tokens > 0
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


def test_the_readme_request_with_default_sampling_names_paris_5_of_5(router):
    """The quick start's request (no temperature: the embedded model's generation_config.json decides) answers
    sensibly every time; a request's own temperature still samples (its 5 seeded answers are not all the
    default's)."""
    client = router.client()
    answers = [client.chat.completions.create(model=MODEL, max_tokens=64, messages=QUESTION).choices[0].message.content
               for _ in range(5)]
    assert all("Paris" in a for a in answers), answers
    sampled = client.chat.completions.create(model=MODEL, max_tokens=64, messages=QUESTION, temperature=1.0, seed=0,
                                             n=5)
    assert {c.message.content for c in sampled.choices} != {answers[0]}


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
    prompt = requests.post(f"{router.base_url}/tokenize", json={"prompt": "The capital of France is"},
                           timeout=10).json()
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


def test_client_that_disconnects_aborts_its_request(router):
    body = {"model": MODEL, "prompt": "Count to one thousand:", "max_tokens": 2000, "ignore_eos": True,
            "stream": True}
    with requests.post(f"{router.base_url}/v1/completions", json=body, stream=True, timeout=30) as resp:
        lines = resp.iter_lines()
        assert next(line for line in lines if line).startswith(b"data: ")
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        stats = router.mesh.stub.GetStats(scheduler_pb2.GetStatsRequest(), timeout=5)
        if stats.num_running == 0 and stats.kv_cache_usage == 0.0:
            break
        time.sleep(0.1)
    assert stats.num_running == 0 and stats.kv_cache_usage == 0.0  # aborted, its blocks freed


def test_grpc_client_sync_and_async(router):
    from stagemesh.client import AsyncClient, Client

    with Client(f"127.0.0.1:{router.grpc_port}") as client:
        assert client.models() == [MODEL]
        answer = client.chat(QUESTION, max_tokens=30)
        assert "Paris" in answer.text and answer.finish_reason == "stop"
        deltas = list(client.chat(QUESTION, max_tokens=30, stream=True))
        assert "".join(d.text for d in deltas) == answer.text
        ids = client.tokenize("The capital of France is")
        by_text = client.generate("The capital of France is", max_tokens=6)
        assert client.generate(ids, max_tokens=6).token_ids == by_text.token_ids and len(by_text.token_ids) == 6

    async def run():
        async with AsyncClient(f"127.0.0.1:{router.grpc_port}") as client:
            whole = await client.generate("The capital of France is", max_tokens=6)
            parts = [d.text async for d in client.generate("The capital of France is", max_tokens=6, stream=True)]
            return whole, parts

    whole, parts = asyncio.run(run())
    assert whole.text == by_text.text == "".join(parts)


def test_grpc_reflection_and_health(router):
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    with grpc.insecure_channel(f"127.0.0.1:{router.grpc_port}") as channel:
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        replies = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5)
        names = {s.name for r in replies for s in r.list_services_response.service}
    assert "stagemesh.v1.Frontend" in names and "grpc.health.v1.Health" in names


def test_langchain_chat_invoke_stream_and_batch(router):
    from langchain_core.messages import HumanMessage
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(model=MODEL, base_url=f"{router.base_url}/v1", api_key="none", temperature=0, max_tokens=24,
                      max_retries=0)
    question = [HumanMessage("What is the capital of France?")]
    answer = chat.invoke(question)
    assert "Paris" in answer.content and answer.usage_metadata["output_tokens"] > 0
    streamed = "".join(chunk.content for chunk in chat.stream(question))
    assert streamed == answer.content
    other = [HumanMessage("Name a fruit.")]
    batch = chat.batch([question, other])
    assert [m.content for m in batch] == [answer.content, chat.invoke(other).content]


def test_langchain_completions_llm(router):
    from langchain_openai import OpenAI

    llm = OpenAI(model=MODEL, base_url=f"{router.base_url}/v1", api_key="none", temperature=0, max_tokens=8,
                 max_retries=0)
    direct = router.client().completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8,
                                                temperature=0).choices[0].text
    assert llm.invoke("The capital of France is") == direct
    assert llm.batch(["The capital of France is", "The capital of France is"]) == [direct, direct]


def test_openai_client_n_echo_and_prompt_logprobs(router):
    client = router.client()
    out = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0.8,
                                    seed=3, n=2, extra_body={"return_token_ids": True})
    assert sorted(c.index for c in out.choices) == [0, 1] and out.usage.completion_tokens == 12
    scored = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=0, echo=True,
                                       logprobs=1)
    choice = scored.choices[0]
    assert choice.text == "The capital of France is" and choice.logprobs.token_logprobs[0] is None
    assert all(lp is not None and lp < 0 for lp in choice.logprobs.token_logprobs[1:])
