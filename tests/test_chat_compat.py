"""What real clients saw differ from vLLM, through the official openai client against the gateway in this
process over a fake replica (tests/fake_replicas.py; word tokenizer: "w5 w6" is [5, 6], the fake replica
answers the prompt's last token + 1, + 2, ...). The real model's agent loops are in tests/test_agents.py."""
from __future__ import annotations


import openai
import pytest
import requests

from fake_replicas import FakeRouter
from tiny_models import with_word_tokenizer

M = "fake-model"
# writes every message's content with '+', as SmolLM2's and most templates do: a None (or missing) content
# fails to render
STRICT_TEMPLATE = "{% for m in messages %}{{ 'w9 ' + m['content'] + ' ' }}{% endfor %}"
# what the template saw of an assistant's tool-call turn: w20 for an empty content, w21 for arguments given
# to it as an object (as vLLM passes them), w22 for anything else
SEEN_TEMPLATE = ("{% for m in messages %}{% if m.tool_calls %}{{ 'w20' if m['content'] == '' else 'w22' }} "
                 "{{ 'w21' if m.tool_calls[0].function.arguments.city == 'Paris' else 'w22' }} "
                 "{% else %}{{ m['content'] }} {% endif %}{% endfor %}")
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}


@pytest.fixture(scope="module")
def router(tiny_model_dir, tmp_path_factory):
    model_dir = with_word_tokenizer(tiny_model_dir("llama"), tmp_path_factory.mktemp("chat-compat") / "tok")
    with FakeRouter(model_dir, M, trust_request_chat_template=True) as r:  # (its requests bring templates)
        yield r


def tokenize(router, **body) -> list[int]:
    resp = requests.post(f"{router.base_url}/tokenize", json=body, timeout=30)
    assert resp.status_code == 200, resp.text
    return resp.json()["tokens"]


@pytest.mark.parametrize("content", ["null", "missing"])
def test_an_agents_second_turn_renders_the_tool_call_turn(router, content):
    assistant = {"role": "assistant", "tool_calls": [CALL], **({"content": None} if content == "null" else {})}
    messages = [{"role": "user", "content": "w5"}, assistant,
                {"role": "tool", "tool_call_id": "call_1", "content": "w7"}]
    out = router.client().chat.completions.create(model=M, messages=messages, max_tokens=2,
                                                  extra_body={"chat_template": STRICT_TEMPLATE})
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 2
    # the template saw "" as the assistant's content and the call's arguments as an object
    assert tokenize(router, messages=messages, chat_template=SEEN_TEMPLATE) == [5, 20, 21, 7]


def test_text_parts_are_joined_by_newlines_as_vllm_joins_them(router):
    parts = [{"type": "text", "text": "w5"}, {"type": "text", "text": "w6"}]
    joined = tokenize(router, messages=[{"role": "user", "content": "w5\nw6"}])
    assert tokenize(router, messages=[{"role": "user", "content": parts}]) == joined == [5, 6]  # "w5w6" is <unk>
    out = router.client().chat.completions.create(model=M, messages=[{"role": "user", "content": parts}],
                                                  max_tokens=1, extra_body={"return_token_ids": True})
    assert out.model_extra["prompt_token_ids"] == [5, 6]


def test_streamed_return_token_ids_give_the_prompt_ids_in_the_first_chunk(router):
    client = router.client()
    chunks = list(client.chat.completions.create(model=M, messages=[{"role": "user", "content": "w5 w6"}],
                                                 max_tokens=3, stream=True, n=2,
                                                 extra_body={"return_token_ids": True}))
    openings = [c for c in chunks if c.choices and c.choices[0].delta.role == "assistant"]
    assert len(openings) == 2 and all(c.model_extra["prompt_token_ids"] == [5, 6] for c in openings)
    assert all("prompt_token_ids" not in c.model_extra for c in chunks if c not in openings)
    chunks = list(client.completions.create(model=M, prompt=[[5, 6], [7]], max_tokens=3, stream=True,
                                            extra_body={"return_token_ids": True}))
    prompts = {c.choices[0].index: c.choices[0].model_extra["prompt_token_ids"] for c in chunks
               if c.choices[0].model_extra.get("prompt_token_ids") is not None}
    assert prompts == {0: [5, 6], 1: [7]}  # once per choice, on its first chunk
    firsts = {}
    for c in chunks:
        firsts.setdefault(c.choices[0].index, c)
    assert all(c.choices[0].model_extra.get("prompt_token_ids") for c in firsts.values())


def test_a_prompt_past_the_context_is_vllms_400_on_input_tokens(router):
    with pytest.raises(openai.BadRequestError) as err:
        router.client().completions.create(model=M, prompt=[5] * 500, max_tokens=20)
    body = err.value.body
    assert err.value.status_code == 400 and body["param"] == "input_tokens" and body["code"] == 400
    assert body["message"].startswith("You passed 500 input tokens and requested 20 output tokens.")
    with pytest.raises(openai.BadRequestError) as err:
        router.client().chat.completions.create(model=M, messages=[{"role": "user", "content": "w5"}],
                                                max_completion_tokens=513)
    assert err.value.body["param"] == "max_completion_tokens" and err.value.body["code"] == 400
