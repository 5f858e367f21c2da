"""Both doors build a request through one builder (router.request_builder): the gRPC frontend refuses what the
HTTP gateway refuses, in the same words, and what both accept reaches the replica as the same request. The
gateway and the frontend run in this process over a fake replica (tests/fake_replicas.py; word tokenizer:
"w5 w6" is [5, 6])."""
from __future__ import annotations

import grpc
import pytest
import requests

from fake_replicas import FakeRouter
from stagemesh.core.sampling_params import SamplingParams
from stagemesh.core.wire import sampling_to_pb
from stagemesh.v1 import frontend_pb2, frontend_pb2_grpc
from tiny_models import with_word_tokenizer

M = "fake-model"
COMP, CHAT = "/v1/completions", "/v1/chat/completions"


@pytest.fixture(scope="module")
def router(tiny_model_dir, tmp_path_factory):
    model_dir = with_word_tokenizer(tiny_model_dir("llama"), tmp_path_factory.mktemp("request-builder") / "tok")
    with FakeRouter(model_dir, M, grpc_frontend=True) as r:
        with grpc.insecure_channel(f"127.0.0.1:{r.grpc_port}") as channel:
            r.stub = frontend_pb2_grpc.FrontendStub(channel)
            yield r


def sampling(**kw) -> dict:
    """A Frontend request's sampling field: SamplingParams' values (max_tokens 0: what the context leaves)."""
    max_tokens = kw.pop("max_tokens", 0)
    msg = sampling_to_pb(SamplingParams(max_tokens=max_tokens or 16, **kw))
    msg.max_tokens = max_tokens
    return {"sampling": msg}


def choice_constraint(*choices: str) -> dict:
    out = sampling()
    out["sampling"].structured_outputs.choice.SetInParent()
    out["sampling"].structured_outputs.choice.choices.extend(choices)
    return out


# (HTTP path, HTTP body, gRPC request): the same thing asked of each door
CASES = [
    (COMP, {"model": "nope", "prompt": "w5"}, frontend_pb2.GenerateRequest(model="nope", text="w5")),
    (COMP, {"prompt": "w5", "n": 300}, frontend_pb2.GenerateRequest(text="w5", n=300)),
    (COMP, {"prompt": "w5", "stop": ["x"] * 65}, frontend_pb2.GenerateRequest(text="w5", stop=["x"] * 65)),
    (COMP, {"prompt": ""}, frontend_pb2.GenerateRequest()),
    (COMP, {"prompt": [5, 999999]}, frontend_pb2.GenerateRequest(token_ids=frontend_pb2.TokenIds(ids=[5, 999999]))),
    (COMP, {"prompt": "w5", "logprobs": 30}, frontend_pb2.GenerateRequest(text="w5", **sampling(logprobs=20))),
    (COMP, {"prompt": "w5", "temperature": 2.5}, frontend_pb2.GenerateRequest(text="w5", **sampling())),
    (COMP, {"prompt": "w5", "max_tokens": 600}, frontend_pb2.GenerateRequest(text="w5", **sampling(max_tokens=600))),
    (COMP, {"prompt": "w5", "max_tokens": 2, "min_tokens": 3},
     frontend_pb2.GenerateRequest(text="w5", **sampling(max_tokens=2))),
    (COMP, {"prompt": "w5", "stop_token_ids": [999999]},
     frontend_pb2.GenerateRequest(text="w5", **sampling(stop_token_ids=(999999,)))),
    (COMP, {"prompt": "w5", "structured_outputs": {"choice": []}},
     frontend_pb2.GenerateRequest(text="w5", **choice_constraint())),
    (CHAT, {"messages": [{"role": "robot", "content": "w5"}]},
     frontend_pb2.ChatRequest(messages=[frontend_pb2.ChatMessage(role="robot", content="w5")])),
    (CHAT, {"messages": []}, frontend_pb2.ChatRequest()),
    # the wire's top_k reads 0 and -1 as off: below is vLLM's 400 at both doors, not off at one
    (COMP, {"prompt": "w5", "top_k": -7}, frontend_pb2.GenerateRequest(text="w5", **sampling())),
    (COMP, {"prompt": " "}, frontend_pb2.GenerateRequest(text=" ")),  # no tokens (word tokenizer)
    # the fields both doors have beside sampling's (frontend.proto's GenerateRequest and ChatRequest)
    (COMP, {"prompt": "w5", "best_of": 2}, frontend_pb2.GenerateRequest(text="w5", best_of=2)),
    (COMP, {"prompt": "w5", "n": 2, "best_of": 1}, frontend_pb2.GenerateRequest(text="w5", n=2, best_of=1)),
    (COMP, {"prompt": "w5", "truncate_prompt_tokens": 0}, frontend_pb2.GenerateRequest(text="w5",
                                                                                     truncate_prompt_tokens=0)),
    (COMP, {"prompt": "w5", "truncate_prompt_tokens": 600}, frontend_pb2.GenerateRequest(text="w5",
                                                                                       truncate_prompt_tokens=600)),
    (COMP, {"prompt": "w5", "truncation_side": "middle"}, frontend_pb2.GenerateRequest(text="w5",
                                                                                      truncation_side="middle")),
    (COMP, {"prompt": "w5", "bad_words": [f"w{i}" for i in range(129)]},
     frontend_pb2.GenerateRequest(text="w5", bad_words=[f"w{i}" for i in range(129)])),
    (CHAT, {"messages": [{"role": "user", "content": "w5"}], "continue_final_message": True},
     frontend_pb2.ChatRequest(messages=[frontend_pb2.ChatMessage(role="user", content="w5")],
                              continue_final_message=True)),
    (CHAT, {"messages": [{"role": "user", "content": "w5"}], "add_generation_prompt": False,
            "continue_final_message": True},
     frontend_pb2.ChatRequest(messages=[frontend_pb2.ChatMessage(role="user", content="w5")],
                              add_generation_prompt=False, continue_final_message=True)),
    (CHAT, {"messages": [{"role": "user", "content": "w5"}], "chat_template_kwargs": {"tools": 1}},
     frontend_pb2.ChatRequest(messages=[frontend_pb2.ChatMessage(role="user", content="w5")],
                              chat_template_kwargs='{"tools": 1}')),
    (CHAT, {"messages": [{"role": "user", "content": "w5"}], "documents": [{"text": 5}]},
     frontend_pb2.ChatRequest(messages=[frontend_pb2.ChatMessage(role="user", content="w5")],
                              documents='[{"text": 5}]')),
    (CHAT, {"messages": [{"role": "user", "content": "w5"}], "chat_template_kwargs": "x"},
     frontend_pb2.ChatRequest(messages=[frontend_pb2.ChatMessage(role="user", content="w5")],
                              chat_template_kwargs='"x"')),
    # this router does not trust requests' own templates (--trust-request-chat-template)
    (CHAT, {"messages": [{"role": "user", "content": "w5"}], "chat_template": "{{ 'w7' }}"},
     frontend_pb2.ChatRequest(messages=[frontend_pb2.ChatMessage(role="user", content="w5")],
                              chat_template="{{ 'w7' }}")),
]
# what a SamplingParams cannot hold is set on the message after it is made
CASES[5][2].sampling.logprobs = 30
CASES[6][2].sampling.temperature = 2.5
CASES[8][2].sampling.min_tokens = 3
CASES[13][2].sampling.top_k = -7


@pytest.mark.parametrize("path,body,request_pb", CASES, ids=[str(i) for i in range(len(CASES))])
def test_the_grpc_frontend_refuses_what_http_refuses_in_the_same_words(router, path, body, request_pb):
    resp = requests.post(router.base_url + path, json={"model": M, **body}, timeout=30)
    assert resp.status_code in (400, 404), resp.text
    call = router.stub.Chat if path == CHAT else router.stub.Generate
    with pytest.raises(grpc.RpcError) as err:
        list(call(request_pb, timeout=30))
    code = grpc.StatusCode.NOT_FOUND if resp.status_code == 404 else grpc.StatusCode.INVALID_ARGUMENT
    assert (err.value.code(), err.value.details()) == (code, resp.json()["error"]["message"])


def test_both_doors_submit_the_same_request(router):
    router.replica.submitted.clear()
    body = {"model": M, "prompt": [5, 6], "max_tokens": 3, "temperature": 0.5, "seed": 7, "top_k": 4,
            "stop_token_ids": [3], "logit_bias": {"9": 2.0}, "logprobs": 2}
    http = requests.post(router.base_url + COMP, json=body, timeout=30).json()
    request = frontend_pb2.GenerateRequest(token_ids=frontend_pb2.TokenIds(ids=[5, 6]), **sampling(
        max_tokens=3, temperature=0.5, seed=7, top_k=4, stop_token_ids=(3,), logit_bias=((9, 2.0),), logprobs=2))
    replies = list(router.stub.Generate(request, timeout=30))
    (_, http_prompt, http_sampling), (_, grpc_prompt, grpc_sampling) = router.replica.submitted
    assert http_prompt == grpc_prompt == [5, 6] and http_sampling == grpc_sampling
    assert "".join(r.text for r in replies) == http["choices"][0]["text"]


USER = [frontend_pb2.ChatMessage(role="user", content="w5")]
BANS = frontend_pb2.GenerateRequest(text="w5", bad_words=["w6"])
BANS.sampling.bad_words.add().token_ids.append(6)


# what only the gRPC door can be sent: tools (a reply cannot carry a tool call, frontend.proto), both spellings of
# bad_words, JSON text that is not JSON
@pytest.mark.parametrize("field,request_pb", [
    ("tools", frontend_pb2.ChatRequest(messages=USER, tools='[{"type": "function", "function": {"name": "f"}}]')),
    ("bad_words", BANS),
    ("documents", frontend_pb2.ChatRequest(messages=USER, documents="[{")),
])
def test_the_grpc_frontend_refuses_its_own_spellings_by_name(router, field, request_pb):
    call = router.stub.Chat if isinstance(request_pb, frontend_pb2.ChatRequest) else router.stub.Generate
    with pytest.raises(grpc.RpcError) as err:
        list(call(request_pb, timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and err.value.details().startswith(f"'{field}'")


# (HTTP body, gRPC request's fields): the fields beside sampling's that shape the prompt, the bans and the text
SHAPED = [
    ({"truncate_prompt_tokens": 2, "truncation_side": "right"}, {"truncate_prompt_tokens": 2,
                                                                 "truncation_side": "right"}),
    ({"truncate_prompt_tokens": 2}, {"truncate_prompt_tokens": 2}),
    ({"add_special_tokens": False, "bad_words": ["w9", "w11 w12"], "best_of": 1},
     {"add_special_tokens": False, "bad_words": ["w9", "w11 w12"], "best_of": 1}),
    ({"stop": ["w9"], "include_stop_str_in_output": True}, {"stop": ["w9"], "include_stop_str_in_output": True}),
    ({"prompt": "w0", "skip_special_tokens": False, "spaces_between_special_tokens": False},
     {"text": "w0", "skip_special_tokens": False, "spaces_between_special_tokens": False}),
]


@pytest.mark.parametrize("body,fields", SHAPED, ids=[str(i) for i in range(len(SHAPED))])
def test_both_doors_read_the_other_fields_alike(router, body, fields):
    router.replica.submitted.clear()
    http = requests.post(router.base_url + COMP, json={"model": M, "prompt": "w5 w6 w7", "max_tokens": 4, **body},
                         timeout=30).json()
    replies = list(router.stub.Generate(frontend_pb2.GenerateRequest(**{"text": "w5 w6 w7", **fields},
                                                                     **sampling(max_tokens=4)), timeout=30))
    (_, http_prompt, http_sampling), (_, grpc_prompt, grpc_sampling) = router.replica.submitted
    assert http_prompt == grpc_prompt and http_sampling.bad_words_token_ids == grpc_sampling.bad_words_token_ids
    assert "".join(r.text for r in replies) == http["choices"][0]["text"]
