"""Every vLLM parameter of the OpenAI API either does what vLLM's does or is refused with a 400 naming it,
through a PP=2 mesh with async scheduling (tiny model, word tokenizer: "w5 w6" is [5, 6])."""
from __future__ import annotations

import json

import grpc
import pytest
import requests

from mesh import Mesh, Router
from stagemesh.client import Client
from stagemesh.core.sampling_params import SamplingParams
from stagemesh.v1 import frontend_pb2, frontend_pb2_grpc
from stagemesh.core.wire import sampling_to_pb
from tiny_models import reference_model, reference_tokens, with_word_tokenizer

pytestmark = pytest.mark.slow
M = "llama-tiny"
EOS = 2
PROMPT = [5, 6, 7, 8, 9]
# prints every role, content (w15 for none), tool call, flag and document, so /tokenize shows what reached it
TEMPLATE = ("{% for m in messages %}{{ {'system': 'w10', 'developer': 'w11', 'user': 'w12', 'assistant': 'w13', "
            "'tool': 'w14'}[m['role']] }} {{ m['content'] or 'w15' }} {% if m.get('tool_calls') %}w18 {% endif %}"
            "{% endfor %}{% if add_generation_prompt %}w16 {% endif %}{% if flag %}w17 {% endif %}"
            "{% for d in documents or [] %}{{ d['text'] }} {% endfor %}")


@pytest.fixture(scope="module")
def model(tiny_model_dir, tmp_path_factory):
    return with_word_tokenizer(tiny_model_dir("llama"), tmp_path_factory.mktemp("params") / "model")


@pytest.fixture(scope="module")
def router(model, tmp_path_factory):
    logs = tmp_path_factory.mktemp("params-logs")
    with Mesh(model, [2, 2], handoff="nccl", scheduler_args=("--async-scheduling",), log_dir=logs) as mesh:
        with Router(model, [mesh.address], ("--served-model-name", M, "--trust-request-chat-template"), log_dir=logs,
                    grpc_frontend=True) as r:  # (TEMPLATE is the requests' own)
            r.logs = logs
            yield r


@pytest.fixture(scope="module")
def greedy(model):
    ref = reference_model(model)
    return lambda prompt, n: reference_tokens(ref, prompt, n)


def complete(router, **body) -> dict:
    resp = requests.post(f"{router.base_url}/v1/completions", json={"model": M, "prompt": PROMPT, "temperature": 0,
                                                                     "max_tokens": 8, **body}, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()


def ids(answer: dict, index: int = 0) -> list[int]:
    return next(c for c in answer["choices"] if c["index"] == index)["token_ids"]


def test_logit_bias_forces_and_forbids(router, greedy):
    free = greedy(PROMPT, 8)
    forced = complete(router, logit_bias={"42": 100}, return_token_ids=True, ignore_eos=True, temperature=1.0)
    assert ids(forced) == [42] * 8
    banned = complete(router, logit_bias={str(free[0]): -100}, return_token_ids=True, max_tokens=1)
    assert ids(banned)[0] != free[0] and ids(complete(router, return_token_ids=True, max_tokens=1)) == free[:1]


def test_allowed_token_ids_restrict_sampling(router):
    answer = complete(router, allowed_token_ids=[11, 12, 13], temperature=1.0, seed=1, max_tokens=20,
                      return_token_ids=True, ignore_eos=True)
    assert set(ids(answer)) <= {11, 12, 13} and len(set(ids(answer))) > 1


def test_bad_words_never_appear(router, greedy):
    free = greedy(PROMPT, 8)
    word = f"w{free[2]}"  # a word the free answer has
    answer = complete(router, bad_words=[word], return_token_ids=True, ignore_eos=True)
    assert free[2] not in ids(answer) and word not in answer["choices"][0]["text"].split()
    assert ids(answer)[:2] == free[:2]  # the same until the word would have come


def test_stop_strings_can_be_kept_and_say_why_they_stopped(router, greedy):
    free = greedy(PROMPT, 8)
    stop = f"w{free[3]}"
    kept = complete(router, stop=[stop], include_stop_str_in_output=True)["choices"][0]
    dropped = complete(router, stop=[stop])["choices"][0]
    assert kept["text"].endswith(stop) and not dropped["text"].endswith(stop)
    assert kept["text"].startswith(dropped["text"])
    assert kept["finish_reason"] == dropped["finish_reason"] == "stop" and kept["stop_reason"] == stop


def test_stop_reason_is_the_stop_token_and_none_for_eos(router):
    by_token = complete(router, logit_bias={"77": 100}, stop_token_ids=[77])["choices"][0]
    assert by_token["finish_reason"] == "stop" and by_token["stop_reason"] == 77
    by_eos = complete(router, logit_bias={str(EOS): 100})["choices"][0]
    assert by_eos["finish_reason"] == "stop" and by_eos["stop_reason"] is None


def test_min_tokens_keeps_eos_away_until_reached(router):
    answer = complete(router, logit_bias={str(EOS): 100}, min_tokens=3, return_token_ids=True)
    assert ids(answer)[-1] == EOS and len(ids(answer)) == 4 and EOS not in ids(answer)[:3]


def test_skip_special_tokens(router):
    forced = dict(logit_bias={str(EOS): 100}, ignore_eos=True, max_tokens=2)
    assert "</s>" in complete(router, skip_special_tokens=False, **forced)["choices"][0]["text"]
    assert "</s>" not in complete(router, **forced)["choices"][0]["text"]
    assert complete(router, spaces_between_special_tokens=False, **forced)["choices"][0]["finish_reason"] == "length"


def test_truncate_prompt_tokens_keeps_the_last_ones(router, greedy):
    long = list(range(20, 60))
    answer = complete(router, prompt=long, truncate_prompt_tokens=7, return_token_ids=True)
    assert answer["usage"]["prompt_tokens"] == 7 and ids(answer) == greedy(long[-7:], 8)
    right = complete(router, prompt=long, truncate_prompt_tokens=7, truncation_side="right", return_token_ids=True)
    assert ids(right) == greedy(long[:7], 8)


def test_n_choices_equal_single_requests_with_the_seed_plus_their_index(router):
    sampled = dict(temperature=1.0, seed=11, ignore_eos=True, return_token_ids=True)
    answer = complete(router, n=3, **sampled)
    singles = [ids(complete(router, **{**sampled, "seed": 11 + i})) for i in range(3)]
    assert [ids(answer, i) for i in range(3)] == singles and len({tuple(s) for s in singles}) == 3
    assert answer["usage"]["prompt_tokens"] == len(PROMPT) and answer["usage"]["completion_tokens"] == 24


def test_n_choices_count_their_prompts_cached_tokens_once(router):
    # 37 tokens: two full 16-token blocks. The siblings of the first choice find them cached (their prompt was
    # computed once); usage counts the prompt's cached tokens once, as its tokens: none the first time (the
    # prompt was new), its two blocks the second time
    prompt = list(range(200, 237))
    client = router.client()
    first, again = (client.completions.create(model=M, prompt=prompt, n=3, max_tokens=2, temperature=0).usage
                    for _ in range(2))
    assert first.prompt_tokens == again.prompt_tokens == 37
    assert first.prompt_tokens_details is None or not first.prompt_tokens_details.cached_tokens
    assert again.prompt_tokens_details.cached_tokens == 32


def test_cache_salt_isolates_the_prefix_cache_and_changes_no_token(router, greedy):
    """vLLM's cache_salt: requests of one salt share their prompt's cached blocks, requests of another salt (or
    none) share none of them; the answers are the model's own either way."""
    prompt = list(range(300, 337))  # 37 tokens: two full 16-token blocks
    want = greedy(prompt, 4)
    client = router.client()

    def run(salt: str | None = None) -> tuple[int, list[int]]:
        extra = {"return_token_ids": True, **({"cache_salt": salt} if salt is not None else {})}
        c = client.completions.create(model=M, prompt=prompt, max_tokens=4, temperature=0, extra_body=extra)
        details = c.usage.prompt_tokens_details
        return (details.cached_tokens or 0) if details else 0, c.choices[0].model_extra["token_ids"]

    assert run("tenant-a") == (0, want)  # the prompt is new
    assert run("tenant-a") == (32, want)  # the same salt: its two blocks
    assert run("tenant-b") == (0, want)  # another salt: none of them
    assert run() == (0, want)  # no salt: none of the salted ones
    assert run() == (32, want)  # ... and its own
    assert run("tenant-b") == (32, want)
    # chat completions take it too
    messages = [{"role": "user", "content": " ".join(f"w{i}" for i in range(400, 440))}]

    def chat(salt: str) -> int:
        c = client.chat.completions.create(model=M, messages=messages, max_tokens=2, temperature=0,
                                           extra_body={"cache_salt": salt})
        details = c.usage.prompt_tokens_details
        return (details.cached_tokens or 0) if details else 0

    assert chat("tenant-a") == 0 and chat("tenant-a") >= 32 and chat("tenant-b") == 0
    # and the gRPC frontend (stagemesh.client)
    with Client(f"127.0.0.1:{router.grpc_port}", model=M) as grpc_client:
        def over_grpc(salt: str) -> tuple[int, list[int]]:
            c = grpc_client.generate(prompt, max_tokens=4, cache_salt=salt)
            return c.cached_tokens, list(c.token_ids)

        assert over_grpc("tenant-c") == (0, want) and over_grpc("tenant-c") == (32, want)
        assert over_grpc("tenant-d") == (0, want) and over_grpc("tenant-a") == (32, want)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_an_empty_cache_salt_is_refused_by_name(router, path):
    body = {"prompt": PROMPT} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "w5"}]}
    for salt, words in (("", "Parameter 'cache_salt' must be a non-empty string if provided."),
                        (7, "'cache_salt' must be a string")):
        resp = requests.post(f"{router.base_url}{path}", json={"model": M, "max_tokens": 2, "cache_salt": salt,
                                                                **body}, timeout=30)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "cache_salt", resp.text
        assert words in resp.json()["error"]["message"]


def test_a_list_of_prompts_gives_each_n_choices_in_openais_order(router, greedy):
    prompts = [[5, 6], [100, 101, 102]]
    answer = complete(router, prompt=prompts, n=2, return_token_ids=True)
    assert sorted(c["index"] for c in answer["choices"]) == [0, 1, 2, 3]
    for index in range(4):
        assert ids(answer, index) == greedy(prompts[index // 2], 8)
    assert answer["usage"]["prompt_tokens"] == 5


def test_logprobs_tokens_offsets_and_token_id_strings(router):
    answer = complete(router, logprobs=2, return_token_ids=True, return_tokens_as_token_ids=True)
    choice = answer["choices"][0]
    lp = choice["logprobs"]
    assert lp["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]
    plain = complete(router, logprobs=2)["choices"][0]["logprobs"]
    # vLLM's text_offset: each token's offset is the previous ones' decoded lengths summed
    assert plain["text_offset"] == [sum(map(len, plain["tokens"][:i])) for i in range(len(plain["tokens"]))]


def test_streaming_echo_and_offsets_match_the_whole_answer(router):
    whole = complete(router, prompt="w5 w6 w7", echo=True, logprobs=1)["choices"][0]
    body = {"model": M, "prompt": "w5 w6 w7", "temperature": 0, "max_tokens": 8, "echo": True, "logprobs": 1,
            "stream": True}
    text, offsets, tokens = "", [], []
    with requests.post(f"{router.base_url}/v1/completions", json=body, stream=True, timeout=120) as resp:
        for line in resp.iter_lines():
            if line.startswith(b"data: {"):
                choice = json.loads(line[6:])["choices"][0]
                text += choice["text"]
                offsets += choice["logprobs"]["text_offset"]
                tokens += choice["logprobs"]["tokens"]
    assert text == whole["text"] and text.startswith("w5 w6 w7 ")  # the echo, then the answer
    assert tokens == whole["logprobs"]["tokens"] and offsets == whole["logprobs"]["text_offset"]
    assert offsets == [sum(map(len, tokens[:i])) for i in range(len(tokens))] and len(tokens) == 3 + 8


CHAT = [{"role": "developer", "content": "w20"}, {"role": "user", "content": "w21"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
                                                                "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "content": "w22", "tool_call_id": "c1"}, {"role": "assistant", "content": "w23"}]


@pytest.mark.parametrize("options,expected", [
    ({}, "w11 w20 w12 w21 w13 w15 w18 w14 w22 w13 w23 w16"),
    ({"add_generation_prompt": False}, "w11 w20 w12 w21 w13 w15 w18 w14 w22 w13 w23"),
    ({"add_generation_prompt": False, "continue_final_message": True}, "w11 w20 w12 w21 w13 w15 w18 w14 w22 w13 w23"),
    ({"chat_template_kwargs": {"flag": True}}, "w11 w20 w12 w21 w13 w15 w18 w14 w22 w13 w23 w16 w17"),
    ({"documents": [{"title": "t", "text": "w30"}]}, "w11 w20 w12 w21 w13 w15 w18 w14 w22 w13 w23 w16 w30"),
], ids=["roles-as-they-are", "no-generation-prompt", "continue-final", "template-kwargs", "documents"])
def test_chat_options_reach_the_template(router, options, expected):
    body = {"model": M, "messages": CHAT, "chat_template": TEMPLATE, **options}
    tokens = requests.post(f"{router.base_url}/tokenize", json=body, timeout=30).json()["tokens"]
    assert tokens == [int(w[1:]) for w in expected.split()]
    chat = {**body, "max_tokens": 2, "temperature": 0, "return_token_ids": True}
    answer = requests.post(f"{router.base_url}/v1/chat/completions", json=chat, timeout=60).json()
    assert answer["prompt_token_ids"] == tokens


def test_chat_echo_continues_the_final_message(router):
    body = {"model": M, "messages": [{"role": "user", "content": "w5"}, {"role": "assistant", "content": "w9 w10"}],
            "continue_final_message": True, "add_generation_prompt": False, "echo": True, "max_tokens": 3,
            "temperature": 0}
    answer = requests.post(f"{router.base_url}/v1/chat/completions", json=body, timeout=60).json()
    assert answer["choices"][0]["message"]["content"].startswith("w9 w10")


def test_request_ids_in_and_out_version_and_openapi(router):
    resp = requests.post(f"{router.base_url}/v1/completions", json={"model": M, "prompt": PROMPT, "max_tokens": 2},
                         headers={"X-Request-Id": "trace-me-7"}, timeout=60)
    assert resp.headers["X-Request-Id"] == "trace-me-7" and resp.json()["id"] == "cmpl-trace-me-7"
    assert "cmpl-trace-me-7" in (router.logs / f"router-{router.port}.log").read_text()
    body = complete(router, request_id="from-the-body")
    assert body["id"] == "cmpl-from-the-body"
    assert requests.get(f"{router.base_url}/version", timeout=5).json()["version"]
    spec = requests.get(f"{router.base_url}/openapi.json", timeout=5).json()
    assert {"/v1/completions", "/v1/chat/completions", "/tokenize"} <= set(spec["paths"])
    assert "logit_bias" in spec["components"]["schemas"]["CompletionRequest"]["properties"]


@pytest.mark.parametrize("field,value", [
    ("length_penalty", 2.0), ("priority", 1),
    ("prompt_embeds", "abc"), ("stream_interval", 2),
    ("vllm_xargs", {"a": 1}), ("logprob_token_ids", [5]), ("repetition_detection", {"n": 2}),
    ("suffix", "w5"), ("best_of", 2),
])
def test_unsupported_vllm_fields_are_refused_by_name(router, field, value):
    resp = requests.post(f"{router.base_url}/v1/completions",
                         json={"model": M, "prompt": PROMPT, "max_tokens": 2, field: value}, timeout=30)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == field, resp.text
    assert field in resp.json()["error"]["message"]


def test_a_field_nobody_defines_is_ignored_with_a_warning(router):
    assert complete(router, frobnicate=3)["choices"][0]["finish_reason"] == "length"
    assert "ignoring unknown request field(s) frobnicate" in (router.logs / f"router-{router.port}.log").read_text()


def test_one_scrape_of_the_gateway_has_the_engine_series(router):
    from prometheus_client.parser import text_string_to_metric_families

    complete(router)
    samples = {}
    for family in text_string_to_metric_families(requests.get(f"{router.base_url}/metrics", timeout=10).text):
        for sample in family.samples:
            if sample.labels.get("model_name") == M:
                samples.setdefault(sample.name, []).append(sample)
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_queries_total",
                 "prefix_cache_hits_total", "num_preemptions_total", "prompt_tokens_total",
                 "generation_tokens_total", "request_success_total", "time_to_first_token_seconds_count",
                 "inter_token_latency_seconds_count", "e2e_request_latency_seconds_count",
                 "request_queue_time_seconds_count"):
        assert f"vllm:{name}" in samples, name
    assert samples["vllm:num_requests_running"][0].labels["engine"] == "0"  # per replica: its index
    lengths = [s.value for s in samples["vllm:request_success_total"] if s.labels["finished_reason"] == "length"]
    assert lengths and lengths[0] >= 1
    assert samples["vllm:generation_tokens_total"][0].value >= 8


def test_the_grpc_frontend_maps_errors_and_serves_n_and_prompt_logprobs(router):
    with grpc.insecure_channel(f"127.0.0.1:{router.grpc_port}") as channel:
        stub = frontend_pb2_grpc.FrontendStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(frontend_pb2.GenerateRequest(model="nope", text="w5"), timeout=30))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        sampling = sampling_to_pb(SamplingParams(max_tokens=3, temperature=1.0, seed=4, prompt_logprobs=0))
        replies = list(stub.Generate(frontend_pb2.GenerateRequest(model=M, token_ids=frontend_pb2.TokenIds(ids=PROMPT),
                                                                  sampling=sampling, n=2), timeout=60))
    assert {r.index for r in replies} == {0, 1}
    assert sum(len(r.prompt_logprobs) for r in replies) == len(PROMPT) - 1
    assert sum(len(r.token_ids) for r in replies) == 6


def test_the_grpc_frontend_takes_the_http_fields_token_exact(router, greedy):
    """The fields beside sampling's, through stagemesh.client's keywords, answer as over HTTP, token for token."""
    first = greedy(PROMPT, 8)
    text = " ".join(f"w{t}" for t in PROMPT)
    cases = [(list(range(20, 60)), {"truncate_prompt_tokens": 7, "truncation_side": "right"}),
             (text, {"add_special_tokens": False, "bad_words": [f"w{first[0]}"], "best_of": 1}),
             (PROMPT, {"stop": [f"w{first[3]}"], "include_stop_str_in_output": True}),
             (PROMPT, {"skip_special_tokens": False, "spaces_between_special_tokens": False,
                       "logit_bias": {EOS: 100}, "ignore_eos": True})]
    with Client(f"127.0.0.1:{router.grpc_port}", model=M) as client:
        for prompt, fields in cases:
            http = complete(router, prompt=prompt, return_token_ids=True,
                            **{k: ({str(t): b for t, b in v.items()} if k == "logit_bias" else v)
                               for k, v in fields.items()})["choices"][0]
            over_grpc = client.generate(prompt, max_tokens=8, **{k: (tuple(v.items()) if k == "logit_bias" else v)
                                                                 for k, v in fields.items()})
            assert (over_grpc.token_ids, over_grpc.text) == (http["token_ids"], http["text"]), fields
        messages = [{"role": "user", "content": "w21"}, {"role": "assistant", "content": "w23"}]
        for options, want in (({"chat_template_kwargs": {"flag": True}, "documents": [{"title": "t", "text": "w30"}]},
                               [12, 21, 13, 23, 16, 17, 30]),  # every option reached the template
                              ({"add_generation_prompt": False, "continue_final_message": True}, [12, 21, 13, 23])):
            chat = {"chat_template": TEMPLATE, **options}
            http = requests.post(f"{router.base_url}/v1/chat/completions", json={
                "model": M, "messages": messages, "max_tokens": 4, "temperature": 0, "return_token_ids": True,
                **chat}, timeout=60).json()
            tokenized = client.stub.Tokenize(frontend_pb2.TokenizeRequest(chat=frontend_pb2.ChatRequest(
                messages=[frontend_pb2.ChatMessage(**m) for m in messages],
                **{k: json.dumps(v) if isinstance(v, (dict, list)) else v for k, v in chat.items()})), timeout=30)
            assert http["prompt_token_ids"] == list(tokenized.token_ids) == want
            answer = client.chat(messages, max_tokens=4, **chat)
            assert answer.token_ids == http["choices"][0]["token_ids"] and len(answer.token_ids) == 4
            assert answer.prompt_tokens == http["usage"]["prompt_tokens"]
