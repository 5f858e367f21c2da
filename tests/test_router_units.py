"""Router pieces without processes: incremental detokenization, stop strings, balancing."""
from __future__ import annotations

from dataclasses import dataclass

import pytest

from router.balancing import CacheAware, LeastLoad, RoundRobin
from router.tokenization import IncrementalDetokenizer, StopStrings, Tokenizer


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    return Tokenizer(default_model_dir)


@pytest.mark.parametrize("text", ["Paris is the capital of France.", "naïve café — 東京 🚀 done",
                                  "  spaces\n\nand\ttabs  ", "def f(x):\n    return x ** 2"])
def test_incremental_detokenization_equals_decoding_all_at_once(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.add([i]) for i in ids]
    assert "".join(pieces) == tokenizer.decode(ids)
    assert all("\ufffd" not in p for p in pieces)  # half a character is never sent


@pytest.mark.parametrize("skip", [True, False])
def test_the_routers_decode_is_transformers_decode(tokenizer, skip):
    """The per-token path calls the Rust decoder itself: the same text as transformers' decode, special tokens
    and broken characters included."""
    import random

    rng = random.Random(0)
    specials = tokenizer.tok.all_special_ids
    windows = [[rng.randrange(tokenizer.vocab_size) for _ in range(rng.randint(1, 8))] for _ in range(300)]
    windows += [[specials[0], *w, specials[-1]] for w in windows[:50]]
    assert tokenizer._rust_decode is not None  # (the default model's is a fast tokenizer)
    for ids in windows:
        assert tokenizer.decode(ids, skip) == tokenizer.tok.decode(ids, skip_special_tokens=skip), ids
    assert [tokenizer.token_text(i) for i in windows[0]] == [tokenizer.tok.decode([i]) for i in windows[0]]


def test_stop_strings_never_leak_across_deltas():
    stops = StopStrings(["STOP", "\n\n"])
    sent = "".join(stops.feed(d) for d in ["Hello wo", "rld S", "TO", "P and more"])
    assert sent == "Hello world " and stops.stopped == "STOP"
    assert stops.feed("later") == ""


def test_stop_strings_release_held_text_at_the_end():
    stops = StopStrings(["STOP"])
    assert stops.feed("abcST") == "ab"  # "ST" could start STOP: held back
    assert stops.flush() == "cST"


@pytest.mark.parametrize("chunk", [1, 2, 3, 5, 100])
def test_a_reply_of_many_tokens_ends_at_the_token_that_completed_the_stop_string(tokenizer, chunk):
    """A resumed stream's backlog (or accepted drafts) arrives as one reply of several tokens: the stream must end
    where it ends token by token, the tokens after the stop string dropped with their logprobs."""
    from router.generation import Delta, _text

    ids = tokenizer.encode("The cat sat on the mat. Then the dog ran far away home.", add_special_tokens=False)

    def run(size: int) -> tuple[str, list[int], list]:
        detok, stops = IncrementalDetokenizer(tokenizer), StopStrings(["dog"])
        text, kept, logprobs = "", [], []
        for start in range(0, len(ids), size):
            delta = Delta(token_ids=ids[start:start + size], logprobs=[f"lp{t}" for t in ids[start:start + size]])
            text += _text(delta, detok, stops)
            kept += delta.token_ids
            logprobs += delta.logprobs
            if stops.stopped is not None:
                break
        return text, kept, logprobs

    one_by_one = run(1)
    assert one_by_one[0] == "The cat sat on the mat. Then the " and len(one_by_one[1]) < len(ids)
    assert run(chunk) == one_by_one
    assert one_by_one[2] == [f"lp{t}" for t in one_by_one[1]]


@dataclass
class FakeLoad:
    """A replica as the policies see it: an address and a load figure."""

    address: str
    load: int = 0


def test_least_load_and_round_robin():
    a, b = FakeLoad("a", 5), FakeLoad("b", 2)
    assert LeastLoad().pick([a, b], [1]) is b
    rr = RoundRobin()
    assert [rr.pick([a, b], [1]).address for _ in range(4)] == ["a", "b", "a", "b"]


def test_cache_aware_follows_the_prefix_until_load_is_unbalanced():
    policy = CacheAware(block=4, balance_abs=8, balance_rel=1.5)
    a, b = FakeLoad("a", 0), FakeLoad("b", 0)
    prompt = list(range(40))
    first = policy.pick([a, b], prompt)
    other = b if first is a else a
    first.load = 3  # a little busier: the cached prefix still wins
    assert policy.pick([a, b], prompt + [99]) is first
    first.load, other.load = 50, 1  # now unbalanced: least-load takes over
    assert policy.pick([a, b], prompt) is other
    assert policy.pick([a, b], [7, 7, 7, 7, 7]) is other  # no match: least loaded


def test_json_depth_is_measured_without_recursion_and_ignores_brackets_in_strings():
    from router.http_body import json_depth

    assert json_depth(b'{"a": [1, {"b": "[[[[{{{{"}]}') == 3
    assert json_depth(b'"just [a] string"') == 0
    assert json_depth(b"[" * 100_000 + b"]" * 100_000) == 100_000


@pytest.mark.parametrize("body,words", [
    (b"[" * 100_000 + b"]" * 100_000, "nests JSON deeper than 64 levels"),
    (b'{"prompt": "\\ud800"}', "'prompt' holds a lone UTF-16 surrogate"),
    (b'{"messages": [{"content": "x\\udfff"}]}', "'messages[0].content' holds a lone UTF-16 surrogate"),
    (b'{"a": 1', "not valid JSON"),
    (b'{"temperature": 1' + b"0" * 5000 + b"}", "Exceeds the limit (4300 digits)"),
    (b"\xff\xfe", "not valid JSON"),
])
def test_bodies_that_cannot_be_text_or_nest_too_deep_are_refused(body, words):
    from router.errors import APIError
    from router.http_body import parse

    with pytest.raises(APIError) as err:
        parse(body)
    assert err.value.status == 400 and words in err.value.message


def test_a_paired_surrogate_escape_is_text():
    from router.http_body import parse

    assert parse(b'{"prompt": "\\ud83d\\ude80"}') == {"prompt": "\U0001F680"}


def test_a_text_longer_than_any_prompt_is_refused_before_tokenizing(default_model_dir):
    from router.errors import APIError

    limited = Tokenizer(default_model_dir, max_positions=10)  # no token is longer than 81 characters
    assert limited.max_text_chars == 810
    limited.check_length(810, "prompt")
    with pytest.raises(APIError, match="'prompt' has 811 characters: more than any prompt this model can take"):
        limited.check_length(811, "prompt")


def test_json_depth_is_linear_on_bodies_built_to_make_a_regex_backtrack():
    import time

    from router.http_body import json_depth

    for body in (b'"' + b'\\"' * 500_000, b'"a' * 500_000, b'["' + b"\\\\" * 500_000 + b'"]'):
        start = time.perf_counter()
        json_depth(body)
        assert time.perf_counter() - start < 1.0  # a quadratic scan takes hours on a megabyte


def test_detokenizing_after_the_prompt_gives_the_text_that_follows_it(tokenizer):
    prompt = tokenizer.encode("The capital of France is", add_special_tokens=False)
    answer = tokenizer.encode("The capital of France is Paris, a city", add_special_tokens=False)[len(prompt):]
    detok = IncrementalDetokenizer(tokenizer, prompt_ids=prompt)
    text = "".join(detok.add([t]) for t in answer)
    assert text == tokenizer.decode(prompt + answer)[len(tokenizer.decode(prompt)):] == " Paris, a city"


def test_stop_strings_can_end_the_text_they_stop():
    stops = StopStrings(["STOP"], include=True)
    assert "".join(stops.feed(d) for d in ["Hello wo", "rld S", "TO", "P and more"]) == "Hello world STOP"


def test_choices_are_planned_per_prompt_and_sample_with_the_seed_plus_their_index():
    from router.choices import plan
    from router.request import GenerateRequest
    from stagemesh.core.sampling_params import SamplingParams

    req = GenerateRequest(model="m", chat=False, n=3, max_tokens_given=True,
                          sampling=SamplingParams(max_tokens=4, temperature=1.0, seed=7, prompt_logprobs=1))
    gens = plan(req, [[5, 6], [7]], "cmpl-x", 64)
    assert [(g.index, g.request_id, g.prompt_ids) for g in gens][:4] == [
        (0, "cmpl-x-0", [5, 6]), (1, "cmpl-x-1", [5, 6]), (2, "cmpl-x-2", [5, 6]), (3, "cmpl-x-3", [7])]
    assert [g.sampling.seed for g in gens] == [7, 8, 9, 7, 8, 9]
    assert [g.sampling.prompt_logprobs for g in gens] == [1, None, None, 1, None, None]  # a prompt is scored once
    single = plan(GenerateRequest(model="m", chat=False, sampling=SamplingParams()), [[5]], "cmpl-y", 64)
    assert single[0].request_id == "cmpl-y" and single[0].sampling.max_tokens == 63  # the room left


def test_bad_words_are_banned_as_they_start_a_text_and_after_a_space(tokenizer):
    from router.prompts import bad_words_token_ids

    words = bad_words_token_ids(tokenizer, ["Paris", " London"])
    assert tuple(tokenizer.encode("Paris", add_special_tokens=False)) in words
    assert tuple(tokenizer.encode(" Paris", add_special_tokens=False)) in words
    assert tuple(tokenizer.encode(" London", add_special_tokens=False)) in words


def test_tool_call_parsers_read_calls_and_hold_back_only_what_may_be_one():
    import json

    from router.tools import HermesParser, Llama3JsonParser

    hermes = HermesParser()
    content, calls = hermes.split('Let me look. <tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>\n'
                                  '<tool_call>{"name": "g", "arguments": {}}</tool_call>')
    assert content == "Let me look." and [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"x": 1}),
                                                                                                  ("g", {})]
    assert hermes.split("no call here") is None
    assert hermes.split("<tool_call>{not json</tool_call>") is None  # the text is the answer then
    assert hermes.may_start("Hello <tool") == len("Hello ") and hermes.may_start("Hello") == 5
    assert hermes.may_start("a <tool_call>{") == 2
    llama = Llama3JsonParser()
    _, calls = llama.split('<|python_tag|>{"name": "f", "parameters": {"x": 2}}; {"name": "g", "parameters": {}}')
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"x": 2}), ("g", {})]
    assert llama.split("Paris is the capital.") is None
    assert llama.may_start('{"na') == 0 and llama.may_start("Paris") == 5


def test_structured_outputs_config_sets_the_json_whitespace_default_and_names_its_flag():
    from router.config import json_any_whitespace
    from stagemesh.core.errors import StagemeshError

    assert json_any_whitespace(None) is False  # compact unless told
    assert json_any_whitespace('{"disable_any_whitespace": true, "backend": "xgrammar"}') is False
    assert json_any_whitespace('{"disable_any_whitespace": false}') is True  # vLLM's default: indentation
    for bad, says in (('{"backend": "outlines"}', "not available"), ('{"whitespace_pattern": " "}', "keys"),
                      ('{"disable_any_whitespace": 1}', "true or false"), ("{", "must be JSON")):
        with pytest.raises(StagemeshError, match=says) as info:
            json_any_whitespace(bad)
        assert "--structured-outputs-config" in str(info.value)
