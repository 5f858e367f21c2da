"""The gateway under generated bodies (hypothesis, from the request schema and beside it): whatever comes
in, the answer is a success or an OpenAI-shaped 4xx, never a 5xx, and the router stays alive (/health) and
ready (/ready: its replica still serves)."""
from __future__ import annotations

import json

import pytest
import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mesh import Mesh, Router
from tiny_models import with_word_tokenizer

pytestmark = pytest.mark.slow
M = "llama-tiny"
PATHS = ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize")

# text with the characters that have broken gateways: lone surrogates, NUL, controls, astral planes
TEXT = st.text(st.characters(categories=("L", "N", "P", "Zs", "Cc", "Cs", "So")), max_size=40)
WORDS = st.lists(st.integers(3, 383).map(lambda i: f"w{i}"), max_size=12).map(" ".join)
NUMBER = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-2**70, 2**70),
                   st.sampled_from([10**400, -10**400, 2**63, 2**31, -2**31 - 1]))
JUNK = st.recursive(st.one_of(st.none(), st.booleans(), NUMBER, TEXT),
                    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(TEXT, inner, max_size=4)),
                    max_leaves=12)
IDS = st.lists(st.one_of(st.integers(0, 400), st.integers(-2**40, 2**40)), max_size=12)
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", "wizard"]),
                                 "content": st.one_of(WORDS, TEXT, JUNK)})
FIELDS = {
    "model": st.one_of(st.just(M), TEXT, JUNK),
    "prompt": st.one_of(WORDS, TEXT, IDS, st.lists(WORDS, max_size=3), JUNK),
    "messages": st.one_of(st.lists(MESSAGE, max_size=3), JUNK),
    "max_tokens": st.one_of(st.integers(-5, 40), st.integers(-2**40, 2**40), JUNK),
    "temperature": st.one_of(st.floats(0, 2), NUMBER, JUNK),
    "top_p": st.one_of(st.floats(0, 1), NUMBER), "top_k": st.one_of(st.integers(-3, 500), NUMBER),
    "min_p": NUMBER, "repetition_penalty": NUMBER, "presence_penalty": NUMBER, "frequency_penalty": NUMBER,
    "seed": st.one_of(st.integers(-2**70, 2**70), JUNK), "stop": st.one_of(TEXT, st.lists(TEXT, max_size=6), JUNK),
    "stop_token_ids": st.one_of(IDS, JUNK), "logprobs": st.one_of(st.booleans(), st.integers(-3, 30), JUNK),
    "top_logprobs": st.one_of(st.integers(-3, 30), JUNK), "stream": st.one_of(st.booleans(), JUNK),
    "stream_options": st.one_of(st.fixed_dictionaries({"include_usage": st.booleans()}), JUNK),
    "ignore_eos": st.one_of(st.booleans(), JUNK), "min_tokens": st.one_of(st.integers(-3, 50), JUNK),
    "echo": st.one_of(st.booleans(), JUNK), "n": st.one_of(st.integers(-2, 3), JUNK),
    "tokens": st.one_of(IDS, JUNK), "add_special_tokens": st.one_of(st.booleans(), JUNK),
}
SERVABLE = st.fixed_dictionaries({"model": st.just(M), "prompt": st.one_of(WORDS.filter(bool), IDS.filter(bool)),
                                  "messages": st.lists(MESSAGE, min_size=1, max_size=3)},
                                 optional={k: v for k, v in FIELDS.items() if k not in ("model", "prompt", "messages")})
# mostly bodies that reach generation (the deep paths), some from nowhere near the schema
BODY = st.one_of(SERVABLE, SERVABLE, SERVABLE, st.fixed_dictionaries({}, optional=FIELDS), JUNK)


@pytest.fixture(scope="module")
def router(tiny_model_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("fuzz")
    model_dir = tiny_model_dir("llama")
    with Mesh(model_dir, [4], log_dir=logs) as mesh:
        with Router(with_word_tokenizer(model_dir, logs / "tok"), [mesh.address],
                    ("--served-model-name", M, "--max-model-len", "64"), log_dir=logs) as r:
            yield r


@settings(max_examples=300, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(path=st.sampled_from(PATHS), body=BODY)
def test_no_body_gets_a_5xx(router, path, body):
    raw = json.dumps(body).encode()  # lone surrogates travel as \\udxxx escapes, as a JSON client sends them
    resp = requests.post(router.base_url + path, data=raw, headers={"Content-Type": "application/json"},
                         timeout=60, stream=True)
    content = resp.content  # a stream is read to its end
    assert resp.status_code < 500, (path, raw[:300], content[:300])
    if resp.status_code >= 400:
        error = json.loads(content)["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert b"InternalServerError" not in content, (path, raw[:300], content[-300:])  # not even mid-stream
    assert requests.get(f"{router.base_url}/health", timeout=10).status_code == 200
    assert requests.get(f"{router.base_url}/ready", timeout=10).status_code == 200


def test_numbers_past_what_a_double_or_the_parser_holds_are_400(router):
    for raw in (b'{"model": "llama-tiny", "prompt": "w5", "temperature": 1' + b"0" * 400 + b"}",
                b'{"model": "llama-tiny", "prompt": "w5", "seed": 1' + b"0" * 5000 + b"}"):
        resp = requests.post(f"{router.base_url}/v1/completions", data=raw, timeout=30,
                             headers={"Content-Type": "application/json"})
        assert resp.status_code == 400, resp.text
