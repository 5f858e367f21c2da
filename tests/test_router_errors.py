"""A table of bad requests: each gets OpenAI's error shape, the right status and a
message naming the problem; the server still serves afterwards. The table runs against the router's app
in this process over a fake replica (tests/fake_replicas.py: parsing needs no model); a full queue, which
needs a real scheduler's, runs against a real mesh."""
from __future__ import annotations

import pytest
import requests

from fake_replicas import FakeRouter
from mesh import Mesh, Router
from tiny_models import with_word_tokenizer
M = "llama-tiny"
CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
MSG = [{"role": "user", "content": "hi"}]

# (path, body or raw bytes, status, words expected in the message, param)
CASES = [
    (CHAT, b"{not json", 400, "not valid JSON", None),
    (CHAT, b"[1, 2]", 400, "must be a JSON object", None),
    (CHAT, {"model": M, "messages": MSG, "use_beam_search": True, "top_p": 0.5}, 400,
     "'top_p' does not apply to beam search", "top_p"),
    (CHAT, {"model": 5, "messages": MSG}, 400, "'model' must be a string", "model"),
    (CHAT, {"model": "gpt-4", "messages": MSG}, 404, "the model 'gpt-4' does not exist", "model"),
    (CHAT, {"model": M}, 400, "'messages' is required", "messages"),
    (CHAT, {"model": M, "messages": []}, 400, "'messages' must be a non-empty array", "messages"),
    (CHAT, {"model": M, "messages": "hi"}, 400, "'messages' must be a non-empty array", "messages"),
    (CHAT, {"model": M, "messages": [5]}, 400, "'messages[0]' must be an object", "messages[0]"),
    (CHAT, {"model": M, "messages": [{"role": "wizard", "content": "x"}]}, 400, "'messages[0].role' must be one of",
     "messages[0].role"),
    (CHAT, {"model": M, "messages": [{"role": "user"}]}, 400, "'messages[0].content' is required",
     "messages[0].content"),
    (CHAT, {"model": M, "messages": [{"role": "user", "content": 5}]}, 400, "'messages[0].content' must be a string",
     "messages[0].content"),
    (CHAT, {"model": M, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "parts must be text parts", "messages[0].content"),
    (CHAT, {"model": M, "messages": MSG, "temperature": "hot"}, 400, "'temperature' must be a number", "temperature"),
    (CHAT, {"model": M, "messages": MSG, "temperature": 3}, 400, "'temperature' must be a number in [0, 2]",
     "temperature"),
    (CHAT, {"model": M, "messages": MSG, "top_p": 0}, 400, "'top_p' must be a number in (0, 1]", "top_p"),
    (CHAT, {"model": M, "messages": MSG, "top_k": -5}, 400, "'top_k' must be -1 or an integer in [0, 2147483647]",
     "top_k"),
    (CHAT, {"model": M, "messages": MSG, "min_p": 1.5}, 400, "'min_p' must be a number in [0, 1]", "min_p"),
    (CHAT, {"model": M, "messages": MSG, "max_tokens": 0}, 400, "'max_tokens' must be an integer in [1, 2147483647]",
     "max_tokens"),
    (CHAT, {"model": M, "messages": MSG, "max_tokens": "10"}, 400, "'max_tokens' must be an integer", "max_tokens"),
    (CHAT, {"model": M, "messages": MSG, "max_completion_tokens": -1}, 400, "'max_completion_tokens' must be",
     "max_completion_tokens"),
    (CHAT, {"model": M, "messages": MSG, "max_tokens": 100000}, 400,
     "max_tokens=100000 cannot be greater than max_model_len=512", "max_tokens"),
    (CHAT, {"model": M, "messages": MSG, "max_completion_tokens": 600}, 400,
     "max_completion_tokens=600 cannot be greater than max_model_len=512", "max_completion_tokens"),
    # vLLM's words and param for a prompt that leaves too little room: the prompt's tokens, not max_tokens
    (COMP, {"model": M, "prompt": [5] * 500, "max_tokens": 20}, 400,
     "You passed 500 input tokens and requested 20 output tokens. However, the model's context length is only 512 "
     "tokens, resulting in a maximum input length of 492 tokens", "input_tokens"),
    (CHAT, {"model": M, "messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]}, 400,
     "'messages[0].tool_calls[0].function.arguments' is not valid JSON",
     "messages[0].tool_calls[0].function.arguments"),
    (CHAT, {"model": M, "messages": MSG, "n": 0}, 400, "'n' must be an integer in [1, 256]", "n"),
    (CHAT, {"model": M, "messages": MSG, "n": 300}, 400, "'n' must be an integer in [1, 256]", "n"),
    (CHAT, {"model": M, "messages": MSG, "stream": "yes"}, 400, "'stream' must be a boolean", "stream"),
    (CHAT, {"model": M, "messages": MSG, "stream_options": {"include_usage": True}}, 400,
     "'stream_options' is only allowed with 'stream': true", "stream_options"),
    (CHAT, {"model": M, "messages": MSG, "stop": 5}, 400, "'stop' must be a string or an array", "stop"),
    (CHAT, {"model": M, "messages": MSG, "stop": ["a"] * 65}, 400, "'stop' takes at most 64 strings", "stop"),
    (CHAT, {"model": M, "messages": MSG, "presence_penalty": 3}, 400, "'presence_penalty' must be a number in [-2, 2]",
     "presence_penalty"),
    (CHAT, {"model": M, "messages": MSG, "frequency_penalty": -2.5}, 400, "'frequency_penalty' must be",
     "frequency_penalty"),
    (CHAT, {"model": M, "messages": MSG, "repetition_penalty": 0}, 400, "'repetition_penalty' must be",
     "repetition_penalty"),
    (CHAT, {"model": M, "messages": MSG, "seed": 1.5}, 400, "'seed' must be", "seed"),
    (CHAT, {"model": M, "messages": MSG, "logprobs": 1}, 400, "'logprobs' must be a boolean", "logprobs"),
    (CHAT, {"model": M, "messages": MSG, "logprobs": True, "top_logprobs": 50}, 400,
     "'top_logprobs' must be an integer in [0, 20]", "top_logprobs"),
    (CHAT, {"model": M, "messages": MSG, "top_logprobs": 2}, 400, "'top_logprobs' needs 'logprobs': true",
     "top_logprobs"),
    (CHAT, {"model": M, "messages": MSG, "stop_token_ids": ["x"]}, 400, "'stop_token_ids' must be an array of integers",
     "stop_token_ids"),
    (CHAT, {"model": M, "messages": MSG, "logit_bias": {"5": 101}}, 400, "'logit_bias' values must be numbers in "
                                                                          "[-100, 100]", "logit_bias"),
    (CHAT, {"model": M, "messages": MSG, "logit_bias": {"x": 1}}, 400, "'logit_bias' keys must be token ids",
     "logit_bias"),
    (CHAT, {"model": M, "messages": MSG, "logit_bias": {"9999": 1}}, 400, "token id 9999 in 'logit_bias' is "
                                                                            "outside the vocabulary", "logit_bias"),
    (CHAT, {"model": M, "messages": MSG, "allowed_token_ids": []}, 400, "'allowed_token_ids' must not be empty",
     "allowed_token_ids"),
    (CHAT, {"model": M, "messages": MSG, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400,
     '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set', "tool_choice"),
    (CHAT, {"model": M, "messages": MSG, "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400,
     "tool_choice names the function 'g', which is not in 'tools'", "tool_choice"),
    (CHAT, {"model": M, "messages": MSG, "tool_choice": "required"}, 400, "'tool_choice' other than \"none\" needs "
                                                                          "'tools'", "tool_choice"),
    (CHAT, {"model": M, "messages": MSG, "tools": [{"type": "function"}], "tool_choice": "required"}, 400,
     "tools[0] must be", "tools"),
    (CHAT, {"model": M, "messages": MSG, "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": "required", "guided_regex": "a"}, 400, "one output constraint at a time: 'tool_choice' "
                                                                  "and 'guided_regex'", "guided_regex"),
    (CHAT, {"model": M, "messages": MSG, "response_format": {"type": "xml"}}, 400,
     "'response_format' type must be text, json_object, json_schema or structural_tag", "response_format"),
    (CHAT, {"model": M, "messages": MSG, "response_format": {"type": "json_schema"}}, 400,
     "needs 'json_schema': {'name': ..., 'schema': {...}}", "response_format"),
    (CHAT, {"model": M, "messages": MSG, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "objec"}}}}, 400, "the json constraint does not compile: Unsupported type "
                                                          "\"objec\"", "response_format"),
    (CHAT, {"model": M, "messages": MSG, "guided_json": "{not json"}, 400, "the JSON schema is not JSON",
     "guided_json"),
    (CHAT, {"model": M, "messages": MSG, "guided_regex": "[a-"}, 400, "the regex constraint does not compile: "
                                                                     "Regex parsing error", "guided_regex"),
    (CHAT, {"model": M, "messages": MSG, "guided_grammar": "root ::= "}, 400, "the grammar constraint does not "
                                                                             "compile", "guided_grammar"),
    (CHAT, {"model": M, "messages": MSG, "guided_choice": []}, 400, "a choice constraint needs 1 to 4096 strings",
     "guided_choice"),
    (CHAT, {"model": M, "messages": MSG, "guided_regex": "a+", "guided_choice": ["a"]}, 400,
     "one output constraint at a time: 'guided_regex' and 'guided_choice'", "guided_choice"),
    (CHAT, {"model": M, "messages": MSG, "structured_outputs": {"regex": "a", "choice": ["a"]}}, 400,
     "takes one of json, regex, choice, grammar, json_object and structural_tag, got regex, choice",
     "structured_outputs"),
    (CHAT, {"model": M, "messages": MSG, "structured_outputs": {"structural_tag": "{not json"}}, 400,
     "the structural tag is not JSON", "structured_outputs"),
    (CHAT, {"model": M, "messages": MSG, "response_format": {"type": "structural_tag", "structures": [{"begin": "<f>"}],
                                                              "triggers": ["<f"]}}, 400,
     "a structural tag's structures are {begin, schema, end}", "response_format"),
    (CHAT, {"model": M, "messages": MSG, "structured_outputs": {"whitespace_pattern": " "}}, 400,
     "'structured_outputs.whitespace_pattern' is not supported", "structured_outputs"),
    (CHAT, {"model": M, "messages": MSG, "structured_outputs": {"jsonn": {}}}, 400,
     "'structured_outputs' has no field 'jsonn'", "structured_outputs"),
    (CHAT, {"model": M, "messages": MSG, "guided_decoding_backend": "outlines", "guided_regex": "a"}, 400,
     "this server compiles with xgrammar", "guided_decoding_backend"),
    (CHAT, {"model": M, "messages": MSG, "guided_regex": "a+", "ignore_eos": True}, 400,
     "'ignore_eos' cannot go with a structured output constraint", "ignore_eos"),
    (CHAT, {"model": M, "messages": MSG, "continue_final_message": True}, 400, "cannot both be true",
     "continue_final_message"),
    (CHAT, {"model": M, "messages": MSG, "continue_final_message": True, "add_generation_prompt": False}, 400,
     "needs the last message to be the assistant's", "continue_final_message"),
    (CHAT, {"model": M, "messages": MSG, "chat_template_kwargs": {"messages": []}}, 400,
     "'chat_template_kwargs' may not set messages", "chat_template_kwargs"),
    (CHAT, {"model": M, "messages": MSG, "chat_template": "{% for %}"}, 400,
     "start the router with --trust-request-chat-template", "chat_template"),
    (CHAT, {"model": M, "messages": MSG, "bad_words": ["w5" * 1500]}, 400, "'bad_words' has 3,000 characters",
     "bad_words"),
    (CHAT, {"model": M, "messages": MSG, "stream": True, "prompt_logprobs": 2}, 400,
     "'prompt_logprobs' are not available when streaming", "prompt_logprobs"),
    (CHAT, {"model": M, "messages": MSG, "truncate_prompt_tokens": 0}, 400, "'truncate_prompt_tokens' must be -1",
     "truncate_prompt_tokens"),
    (CHAT, {"model": M, "messages": MSG, "ignore_eos": "no"}, 400, "'ignore_eos' must be a boolean", "ignore_eos"),
    (CHAT, {"model": M, "messages": MSG, "min_tokens": 50, "max_tokens": 10}, 400,
     "min_tokens must be in [0, max_tokens]", None),
    (COMP, {"model": M}, 400, "'prompt' is required", "prompt"),
    (COMP, {"model": M, "prompt": ""}, 400, "'prompt' must not be empty", "prompt"),
    (COMP, {"model": M, "prompt": [1, "a"]}, 400, "'prompt' must be", "prompt"),
    (COMP, {"model": M, "prompt": [["w5"]]}, 400, "'prompt' must be a string, an array of strings", "prompt"),
    (COMP, {"model": M, "prompt": ["w5", ""]}, 400, "'prompt' must not be empty (nor any prompt in it)", "prompt"),
    (COMP, {"model": M, "prompt": "w5", "suffix": "x"}, 400, "'suffix' is not supported", "suffix"),
    (COMP, {"model": M, "prompt": "w5", "best_of": 2}, 400, "'best_of' is not supported", "best_of"),
    (COMP, {"model": M, "prompt": "w5", "logprobs": -1}, 400, "-1, the whole vocabulary, is not served", "logprobs"),
    (COMP, {"model": M, "prompt": [5, 999999]}, 400, "token id 999999 is outside the vocabulary", "prompt"),
    (COMP, {"model": M, "prompt": [5] * 600}, 400, "You passed 600 input tokens, which leaves no room for output",
     "input_tokens"),
    (COMP, {"model": M, "prompt": "hi", "logprobs": 30}, 400, "'logprobs' must be an integer in [0, 20]", "logprobs"),
    ("/v1/embeddings", {"model": M, "input": "x"}, 400, "The model does not support Embeddings API", None),
    ("/tokenize", {"nothing": 1}, 400, "'prompt' (a string) or 'messages' is required", "prompt"),
    ("/detokenize", {"tokens": "abc"}, 400, "'tokens' must be an array of integers", "tokens"),
]


@pytest.fixture(scope="module")
def router(tiny_model_dir, tmp_path_factory):
    model_dir = with_word_tokenizer(tiny_model_dir("llama"), tmp_path_factory.mktemp("router-errors") / "tok")
    with FakeRouter(model_dir, M, api_key="sekret") as r:
        yield r


@pytest.mark.parametrize("path,body,status,words,param", CASES, ids=[f"{i}-{c[2]}" for i, c in enumerate(CASES)])
def test_bad_request(router, path, body, status, words, param):
    headers = {"Authorization": "Bearer sekret", "Content-Type": "application/json"}
    kwargs = {"data": body} if isinstance(body, bytes) else {"json": body}
    resp = requests.post(router.base_url + path, headers=headers, timeout=30, **kwargs)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert words in error["message"] and set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status  # vLLM's code: the HTTP status
    if param is not None:
        assert error["param"] == param


def test_missing_or_wrong_api_key_is_401(router):
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        resp = requests.post(router.base_url + CHAT, json={"model": M, "messages": MSG}, headers=headers, timeout=10)
        assert resp.status_code == 401 and "API key" in resp.json()["error"]["message"]


def test_server_still_serves_after_the_bad_requests(router):
    client = router.client(api_key="sekret")
    out = client.completions.create(model=M, prompt=[5, 6, 7], max_tokens=4, temperature=0)
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 4
    assert out.choices[0].text == " w8 w9 w10 w11"  # the fake replica's tokens 8 to 11, after the prompt
    # none of the bad requests reached the replica
    assert [prompt for _, prompt, _ in router.replica.submitted] == [[5, 6, 7]]


@pytest.mark.slow

def _concurrent(url: str, body: dict, n: int) -> list[requests.Response]:
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(lambda _: requests.post(url, json=body, timeout=120), range(n)))


def _busy(answers: list[requests.Response], words: str) -> None:
    busy = [a for a in answers if a.status_code == 429]
    assert busy and all(a.headers.get("Retry-After") for a in busy), [a.status_code for a in answers]
    assert words in busy[0].json()["error"]["message"]
    assert any(a.status_code == 200 for a in answers)


@pytest.mark.slow  # starts processes
def test_full_queue_is_429_with_retry_after(tiny_model_dir, tmp_path):
    # the scheduler's queue (RESOURCE_EXHAUSTED), then the router's own --max-waiting-requests; prefill in
    # chunks of 16 tokens keeps a long prompt waiting for its first token for many steps
    model_dir = tiny_model_dir("llama")
    tok_dir = with_word_tokenizer(model_dir, tmp_path / "tok")
    with Mesh(model_dir, [4], scheduler_args=("--max-waiting-requests", "1", "--max-num-seqs", "1",
                                              "--max-num-batched-tokens", "16"), log_dir=tmp_path) as mesh:
        with Router(tok_dir, [mesh.address], ("--served-model-name", M), log_dir=tmp_path) as r:
            body = {"model": M, "prompt": [5, 6, 7], "max_tokens": 300, "ignore_eos": True}
            _busy(_concurrent(r.base_url + COMP, body, 6), "waiting queue is full")
        with Router(tok_dir, [mesh.address], ("--served-model-name", M, "--max-waiting-requests", "1"),
                    log_dir=tmp_path) as r:
            body = {"model": M, "prompt": [5, 6, 7] * 100, "max_tokens": 8, "ignore_eos": True}
            _busy(_concurrent(r.base_url + COMP, body, 4), "--max-waiting-requests 1")
