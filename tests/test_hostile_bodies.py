"""No body gives a 5xx: every field of every endpoint's schema (and the fields vLLM knows beside them) set to
each value of a battery of hostile ones (wrong types, huge and negative integers, NaN and infinities, nested
garbage, huge lists, text a tokenizer drops), alone and streamed, is a success or an OpenAI-shaped 4xx that
names a field, and nothing in a stream is an internal error. The gateway is the router's app in this process
over a fake replica (tests/fake_replicas.py): what is checked here happens before a replica sees anything.
Then the finding that started it: bad_words with 10,000 entries (the default model's tokenizer) is a 400
naming bad_words, bounded as vLLM bounds it."""
from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from fake_replicas import FakeRouter
from router.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from router.responses_api.request import ResponsesRequest
from stagemesh.core.sampling_params import MAX_NUM_BAD_WORDS
from tiny_models import with_word_tokenizer

M = "fake-model"
BASES = {  # a servable body of each endpoint, and its schema
    "/v1/completions": ({"model": M, "prompt": "w5 w6", "max_tokens": 2}, CompletionRequest),
    "/v1/chat/completions": ({"model": M, "messages": [{"role": "user", "content": "w5"}], "max_tokens": 2},
                             ChatCompletionRequest),
    "/v1/responses": ({"model": M, "input": "w5", "max_output_tokens": 2}, ResponsesRequest),
    "/tokenize": ({"model": M, "prompt": "w5"}, TokenizeRequest),
    "/detokenize": ({"model": M, "tokens": [5]}, DetokenizeRequest),
}
STREAMED = ("/v1/completions", "/v1/chat/completions", "/v1/responses")
# vLLM's fields that a schema here may lack (an unknown field is ignored, as vLLM ignores it)
VLLM_FIELDS = ("best_of", "bad_words", "n", "logprobs", "top_logprobs", "prompt_logprobs", "min_tokens",
               "truncate_prompt_tokens", "priority", "use_beam_search", "length_penalty", "echo", "suffix")
HOSTILE = [-1, 0, -2**31 - 1, 2**64, 1.5, float("nan"), float("inf"), "x", " ", "\ud800", [], {}, None, True,
           [None], [" "], [-1], ["x"] * 10_000, [{}], {"a": {"b": [1, {"c": None}]}}]
STREAM_HOSTILE = [-1, 0, 2**31, float("nan"), [" "]]


@pytest.fixture(scope="module")
def gateway(tiny_model_dir, tmp_path_factory):
    model = with_word_tokenizer(tiny_model_dir("llama"), tmp_path_factory.mktemp("hostile") / "tok")
    with FakeRouter(model, M) as router:
        yield router


def bodies():
    for path, (base, schema) in BASES.items():
        for field in dict.fromkeys([*schema.model_fields, *VLLM_FIELDS]):
            for value in HOSTILE:
                yield path, {**base, field: value}
            for value in STREAM_HOSTILE if path in STREAMED else ():
                yield path, {**base, field: value, "stream": True}


@pytest.mark.slow  # some 4,400 requests
def test_no_hostile_value_of_any_field_gets_a_5xx(gateway):
    local = threading.local()

    def post(item: tuple[str, dict]) -> None:
        path, body = item
        session = local.__dict__.setdefault("session", requests.Session())
        raw = json.dumps(body)  # (NaN and Infinity as Python writes them, which the gateway's parser reads)
        resp = session.post(gateway.base_url + path, data=raw, headers={"Content-Type": "application/json"},
                            timeout=30)
        where = (path, raw[:200], resp.status_code, resp.content[:300])
        assert resp.status_code < 500 and b"InternalServerError" not in resp.content, where
        if resp.status_code >= 400:
            error = resp.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["code"] == resp.status_code, where
            assert error["message"], where

    start, items = time.monotonic(), list(bodies())
    with ThreadPoolExecutor(4) as pool:  # (the client's own work overlaps the gateway's)
        list(pool.map(post, items))
    print(f"{len(items)} bodies in {time.monotonic() - start:.1f} s, none answered with a 5xx")
    assert requests.get(gateway.base_url + "/health", timeout=5).status_code == 200


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"model": M, "prompt": [" "], "max_tokens": 2}, "prompt"),
    ("/v1/chat/completions", {"model": M, "messages": [{"role": "user", "content": " "}], "max_tokens": 2},
     "messages"),
    ("/v1/responses", {"model": M, "input": "", "max_output_tokens": 2}, "input"),
])
def test_a_prompt_of_no_tokens_is_a_400(gateway, path, body, param):
    """Whitespace the (word) tokenizer drops, with a chat template that adds nothing: vLLM's 400, not a
    replica's error (these were 500s)."""
    resp = requests.post(gateway.base_url + path, json=body, timeout=30)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and "prompt cannot be empty" in error["message"], error


@pytest.fixture(scope="module")
def default_gateway(default_model_dir):
    with FakeRouter(default_model_dir, M) as router:
        yield router


@pytest.mark.slow  # loads the default model's tokenizer
def test_ten_thousand_bad_words_are_a_400_bounded_as_vllm_bounds_them(default_gateway):
    words = [f"word{i}" for i in range(10_000)]
    for path, body in [("/v1/completions", {"model": M, "prompt": "Hi", "max_tokens": 2}),
                       ("/v1/chat/completions", {"model": M, "messages": [{"role": "user", "content": "Hi"}],
                                                 "max_tokens": 2})]:
        start = time.monotonic()
        resp = requests.post(default_gateway.base_url + path, json={**body, "bad_words": words}, timeout=60)
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert error["param"] == "bad_words" and error["message"] == (
            f"Too many bad words after tokenization: 10000. The max number is {MAX_NUM_BAD_WORDS}."), error
        assert time.monotonic() - start < 5  # refused by its count, not after 20,000 encodes
    # the bound is on token sequences: a word and its spaced form may be two, as in vLLM
    few = requests.post(default_gateway.base_url + "/v1/completions", timeout=60, json={
        "model": M, "prompt": "Hi", "max_tokens": 2, "bad_words": ["hello", "world"]})
    assert few.status_code == 200, few.text
    many = requests.post(default_gateway.base_url + "/v1/completions", timeout=60, json={
        "model": M, "prompt": "Hi", "max_tokens": 2, "bad_words": [f"w{i}x" for i in range(100)]})
    assert many.status_code == 400 and many.json()["error"]["param"] == "bad_words", many.text
    assert "The max number is 128." in many.json()["error"]["message"]


COMPLETION, CHAT, RESPONSES = (BASES[p][0] for p in ("/v1/completions", "/v1/chat/completions", "/v1/responses"))
INCLUDE = {"include": ["message.output_text.logprobs"]}
# every integer field, out of vLLM's range or of the wrong type: (path, body, the field the 400 names)
OUT_OF_RANGE = [
    *[(path, {**body, "best_of": v}, "best_of") for path, body in (("/v1/completions", COMPLETION),
                                                                     ("/v1/chat/completions", CHAT))
      for v in (-1, 0, 2, 1.0, "1", True)],
    ("/v1/completions", {**COMPLETION, "n": 2, "best_of": 1}, "best_of"),
    *[(path, {**body, field: v}, field) for path, body in (("/v1/completions", COMPLETION),
                                                            ("/v1/chat/completions", CHAT))
      for field, values in (("n", (0, -1, 257, 2**64, 1.5)), ("max_tokens", (0, -1, 2**31, "2")),
                            ("top_k", (-2, 2**31, 1.5)), ("min_tokens", (-1, 2**31, 3)),
                            ("prompt_logprobs", (-1, 21, 2**63)), ("seed", (2**63, -2**63 - 1, "7")),
                            ("truncate_prompt_tokens", (0, -2, 2**31, 1.5)), ("priority", (2**31, -2**31 - 1, 5)))
      for v in values],
    *[("/v1/completions", {**COMPLETION, "logprobs": v}, "logprobs") for v in (-1, 21, True)],
    *[("/v1/chat/completions", {**CHAT, "max_completion_tokens": v}, "max_completion_tokens") for v in (0, -1, 2**31)],
    *[("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": v}, "top_logprobs") for v in (-1, 21, 1.0)],
    ("/v1/chat/completions", {**CHAT, "logprobs": 1}, "logprobs"),
    *[("/v1/responses", {**RESPONSES, "max_output_tokens": v}, "max_output_tokens") for v in (0, -1, 2**31, "2")],
    *[("/v1/responses", {**RESPONSES, **INCLUDE, "top_logprobs": v}, "top_logprobs") for v in (-1, 21, 2.0)],
    *[("/v1/responses", {**RESPONSES, field: v}, field) for field, values in (
        ("top_k", (-2, 2**31)), ("seed", (2**64,)), ("priority", (2**31, 5))) for v in values],
]


def test_every_integer_field_out_of_range_is_a_400_naming_it(gateway):
    for path, body, field in OUT_OF_RANGE:
        resp = requests.post(gateway.base_url + path, json=body, timeout=30)
        assert resp.status_code == 400, (path, body, resp.text)
        assert resp.json()["error"]["param"] == field, (path, body, resp.text)
    negative = requests.post(gateway.base_url + "/v1/completions", json={**COMPLETION, "best_of": -1}, timeout=30)
    assert negative.json()["error"]["message"] == "best_of must be greater than or equal to n, got n=1 and best_of=-1."
    for path, body in (("/v1/completions", {**COMPLETION, "best_of": 1}),
                       ("/v1/chat/completions", {**CHAT, "best_of": 1}),
                       ("/v1/completions", {**COMPLETION, "n": 2, "best_of": None})):
        assert requests.post(gateway.base_url + path, json=body, timeout=30).status_code == 200


def test_a_seed_at_the_top_of_int64_with_n_choices_is_served(gateway):
    """Choice i samples with seed + i: past 2**63 - 1 it wraps around as int64 does (it was a 500)."""
    top = 2**63 - 1
    gateway.replica.submitted.clear()
    resp = requests.post(gateway.base_url + "/v1/completions", json={**COMPLETION, "seed": top, "n": 3}, timeout=30)
    assert resp.status_code == 200 and len(resp.json()["choices"]) == 3, resp.text
    assert sorted(s.seed for _, _, s in gateway.replica.submitted) == [-2**63, -2**63 + 1, top]


def test_min_tokens_without_max_tokens_is_checked_against_the_room_the_prompt_leaves(gateway):
    """As vLLM: max_tokens defaults to what the context leaves (510 here), and min_tokens is checked against it
    (min_tokens 20 was refused against a default of 16)."""
    body = {"model": M, "prompt": "w5 w6"}
    assert requests.post(gateway.base_url + "/v1/completions", json={**body, "min_tokens": 20}, timeout=30
                         ).status_code == 200
    resp = requests.post(gateway.base_url + "/v1/completions", json={**body, "min_tokens": 511}, timeout=30)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"] == {"message": "min_tokens must be less than or equal to max_tokens=510, got 511.",
                                    "type": "BadRequestError", "param": "min_tokens", "code": 400}
