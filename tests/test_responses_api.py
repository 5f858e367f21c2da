"""The Responses API (POST /v1/responses, the store) through the official openai client, against the gateway
in this process over a fake replica (tests/fake_replicas.py: word tokenizer, "w5 w6" is [5, 6]; the replica
answers the prompt's last token + 1, + 2, ...; its chat template writes each message's content). Tools,
structured output and the OpenAI Agents SDK's and LangChain's loops with a real model: tests/test_agents.py."""
from __future__ import annotations

import json

import openai
import pytest
import requests

from fake_replicas import FakeRouter
from tiny_models import with_word_tokenizer

M = "fake-model"


@pytest.fixture(scope="module")
def router(tiny_model_dir, tmp_path_factory):
    model_dir = with_word_tokenizer(tiny_model_dir("llama"), tmp_path_factory.mktemp("responses") / "tok")
    with FakeRouter(model_dir, M, responses_store_size=3) as r:
        yield r


def last_prompt(router) -> list[int]:
    return router.replica.submitted[-1][1]


def test_text_in_and_out_with_usage_and_length_as_incomplete(router):
    client = router.client()
    out = client.responses.create(model=M, input="w5 w6", max_output_tokens=3)
    assert last_prompt(router) == [5, 6]
    assert out.output_text == " w7 w8 w9" and out.id.startswith("resp_") and out.model == M
    assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"
    assert (out.usage.input_tokens, out.usage.output_tokens, out.usage.total_tokens) == (2, 3, 5)
    [item] = out.output
    assert item.type == "message" and item.role == "assistant" and item.content[0].type == "output_text"
    # a stop string ends it as completed
    out = client.responses.create(model=M, input="w5 w6", max_output_tokens=5, extra_body={"stop": [" w9"]})
    assert out.status == "completed" and out.output_text == " w7 w8"


def test_metadata_user_and_the_request_echo_back_and_the_schema_is_published(router):
    out = router.client().responses.create(model=M, input="w5", max_output_tokens=1, metadata={"ticket": "42"},
                                           user="u1", temperature=0.5)
    assert (out.metadata, out.user, out.temperature, out.tool_choice, out.store) == ({"ticket": "42"}, "u1", 0.5,
                                                                                      "auto", True)
    spec = requests.get(f"{router.base_url}/openapi.json", timeout=10).json()
    assert "previous_response_id" in spec["components"]["schemas"]["ResponsesRequest"]["properties"]
    resp = requests.post(f"{router.base_url}/v1/responses", timeout=10, json={
        "model": M, "input": "w5", "metadata": {f"k{i}": "v" for i in range(17)}})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "metadata"


def test_instructions_and_message_items_become_the_conversation(router):
    client = router.client()
    client.responses.create(model=M, instructions="w20", input=[
        {"role": "user", "content": "w5"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "w6"}]},
        {"role": "user", "content": [{"type": "input_text", "text": "w7"}, {"type": "input_text", "text": "w8"}]}],
        max_output_tokens=1)
    assert last_prompt(router) == [20, 5, 6, 7, 8]


def test_a_stream_is_vllms_events_in_order_and_ends_with_the_response(router):
    client = router.client()
    with client.responses.stream(model=M, input="w5 w6", max_output_tokens=4, extra_body={"stop": [" w10"]}) as s:
        events = list(s)
        final = s.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(deltas) == final.output_text == " w7 w8 w9" and len(deltas) == 3
    assert final.status == "completed" and final.usage.output_tokens == 4
    raw = requests.post(f"{router.base_url}/v1/responses", json={"model": M, "input": "w5", "stream": True,
                                                                 "max_output_tokens": 2}, stream=True, timeout=30)
    lines = [line for line in raw.iter_lines() if line]
    assert lines[0] == b"event: response.created" and lines[1].startswith(b"data: {")
    assert lines[-2] == b"event: response.incomplete" and b"[DONE]" not in b"".join(lines)  # as vLLM: no [DONE]


def test_the_message_item_of_an_incomplete_response_is_incomplete_too(router):
    """Cut at max_output_tokens, the response and its message item both say incomplete, whole and streamed (the
    item in response.output_item.done and in the closing event's response); ended by a stop, both completed."""
    client = router.client()
    out = client.responses.create(model=M, input="w5 w6", max_output_tokens=2)
    assert out.status == "incomplete" and [item.status for item in out.output] == ["incomplete"]
    with client.responses.stream(model=M, input="w5 w6", max_output_tokens=2) as s:
        events = list(s)
    [done] = [e for e in events if e.type == "response.output_item.done"]
    assert done.item.type == "message" and done.item.status == "incomplete"
    assert events[-1].type == "response.incomplete" and events[-1].response.output[0].status == "incomplete"
    for stream in (False, True):
        body = dict(model=M, input="w5 w6", max_output_tokens=5, extra_body={"stop": [" w9"]})
        if stream:
            with client.responses.stream(**body) as s:
                events = list(s)
            [done] = [e for e in events if e.type == "response.output_item.done"]
            assert done.item.status == "completed" and events[-1].type == "response.completed"
            out = events[-1].response
        else:
            out = client.responses.create(**body)
        assert out.status == "completed" and [item.status for item in out.output] == ["completed"]


def test_previous_response_id_continues_the_stored_conversation(router):
    client = router.client()
    first = client.responses.create(model=M, instructions="w30", input="w5", max_output_tokens=2)
    assert last_prompt(router) == [30, 5]
    second = client.responses.create(model=M, previous_response_id=first.id, input="w9", max_output_tokens=2)
    # the earlier input and answer, then the new input; the earlier instructions do not carry over
    assert last_prompt(router) == [5, 6, 7, 9]
    assert second.previous_response_id == first.id
    assert client.responses.retrieve(second.id).output_text == second.output_text
    third = client.responses.create(model=M, previous_response_id=second.id, input="w40", max_output_tokens=1)
    assert last_prompt(router) == [5, 6, 7, 9, 10, 11, 40]
    client.responses.delete(third.id)
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.retrieve(third.id)
    assert "not found" in err.value.body["message"]
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.create(model=M, previous_response_id=third.id, input="w5")
    assert err.value.body["param"] == "previous_response_id"


def test_the_store_is_bounded_and_store_false_keeps_nothing(router):
    client = router.client()
    unstored = client.responses.create(model=M, input="w5", max_output_tokens=1, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    ids = [client.responses.create(model=M, input="w5", max_output_tokens=1).id for _ in range(4)]
    with pytest.raises(openai.NotFoundError) as err:  # the store holds the last 3 (--responses-store-size)
        client.responses.retrieve(ids[0])
    assert "older than the last 3" in err.value.body["message"]
    assert [client.responses.retrieve(i).id for i in ids[1:]] == ids[1:]
    resp = requests.post(f"{router.base_url}/v1/responses/{ids[-1]}/cancel", timeout=10)
    assert resp.status_code == 400 and "Cannot cancel a synchronous response" in resp.json()["error"]["message"]


def test_function_call_items_and_their_outputs_reach_the_template(router):
    client = router.client()
    client.responses.create(model=M, max_output_tokens=1, input=[
        {"role": "user", "content": "w5"},
        {"type": "function_call", "call_id": "call_1", "name": "lookup", "arguments": '{"q": "x"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "w12"}])
    assert last_prompt(router) == [5, 12]  # the call's turn renders with empty content, then the tool's output


@pytest.mark.parametrize("body,param,words", [
    ({"tools": [{"type": "web_search"}]}, "tools[0].type", "only function tools"),
    ({"tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "web_search"}}, "tool_choice",
     "not supported"),
    ({"background": True}, "background", "background mode is not supported"),
    ({"conversation": "conv_1"}, "conversation", "use previous_response_id"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt", "prompt templates"),
    ({"truncation": "auto"}, "truncation", "only 'disabled'"),
    ({"reasoning": {"summary": "auto"}}, "reasoning", "no summary"),
    ({"reasoning": {"effort": "extreme"}}, "reasoning.effort", "reasoning.effort"),
    ({"include": ["file_search_call.results"]}, "include", "only 'message.output_text.logprobs'"),
    ({"top_logprobs": 3}, "top_logprobs", "needs 'include'"),
    ({"max_tool_calls": 2}, "max_tool_calls", "built-in tool"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type", "input items are messages"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type", "not supported"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]",
     "other modalities"),
    ({"max_output_tokens": 0}, "max_output_tokens", "'max_output_tokens' must be an integer in [1"),
    ({"max_output_tokens": 600}, "max_output_tokens", "max_output_tokens=600 cannot be greater than"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format", "json_schema"),
    ({"input": [{"role": "wizard", "content": "w5"}]}, "input[0].role", "must be user, system"),
    ({"priority": 1}, "priority", "Priority scheduling is not enabled"),
    ({"cache_salt": ""}, "cache_salt", "Parameter 'cache_salt' must be a non-empty string if provided."),
])
def test_what_is_not_built_is_refused_by_name(router, body, param, words):
    resp = requests.post(f"{router.base_url}/v1/responses", json={"model": M, "input": "w5", **body}, timeout=30)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and words in error["message"] and error["code"] == 400, error


def test_a_cache_salt_reaches_the_replica(router):
    router.client().responses.create(model=M, input="w5", max_output_tokens=1, extra_body={"cache_salt": "t-1"})
    assert router.replica.requests[-1].cache_salt == "t-1"
    router.client().responses.create(model=M, input="w5", max_output_tokens=1)
    assert router.replica.requests[-1].cache_salt == ""


def test_logprobs_come_with_include(router):
    out = router.client().responses.create(model=M, input="w5", max_output_tokens=2, top_logprobs=0,
                                           include=["message.output_text.logprobs"])
    # the fake replica sends no logprobs: the field is there, empty (a real model's are in tests/test_agents.py)
    assert out.output[0].content[0].logprobs == []
    assert json.loads(out.model_dump_json())["output"][0]["content"][0]["logprobs"] == []
