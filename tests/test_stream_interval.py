"""--stream-interval (vLLM's): a choice's output goes out every N tokens, its first token at once and its last with
the finish; the text, the token ids and where a stop string ends the stream are those of interval 1. Through the
gateway in this process over a fake replica (word tokenizer: "w5 w6" is [5, 6]; the fake replica answers the
prompt's last token + 1, + 2, ...)."""
from __future__ import annotations

import pytest

from fake_replicas import FakeRouter
from router.config import RouterConfig
from stagemesh.core.errors import StagemeshError
from tiny_models import with_word_tokenizer

M = "fake-model"


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir, tmp_path_factory):
    return with_word_tokenizer(tiny_model_dir("llama"), tmp_path_factory.mktemp("stream-interval") / "tok")


def stream(model_dir, interval: int, **body) -> list:
    with FakeRouter(model_dir, M, stream_interval=interval) as router:
        return [c.choices[0] for c in router.client().completions.create(
            model=M, prompt=[5, 6], stream=True, extra_body={"return_token_ids": True}, **body)]


@pytest.mark.parametrize("n", [2, 4, 7])
def test_chunks_gather_n_tokens_after_the_first_and_say_the_same(model_dir, n):
    one = stream(model_dir, 1, max_tokens=10)
    many = stream(model_dir, n, max_tokens=10)
    assert [len(c.model_extra["token_ids"]) for c in one] == [1] * 10
    sizes = [len(c.model_extra["token_ids"]) for c in many]
    assert sizes[0] == 1 and all(s == n for s in sizes[1:-1]) and 1 <= sizes[-1] <= n and sum(sizes) == 10
    assert "".join(c.text for c in many) == "".join(c.text for c in one)
    assert [t for c in many for t in c.model_extra["token_ids"]] == list(range(7, 17))
    assert many[-1].finish_reason == "length" and all(c.finish_reason is None for c in many[:-1])


def test_a_stop_string_inside_a_gathered_chunk_ends_the_stream_where_it_would_token_by_token(model_dir):
    one = stream(model_dir, 1, max_tokens=20, stop=["w11"])
    many = stream(model_dir, 5, max_tokens=20, stop=["w11"])
    assert "".join(c.text for c in many) == "".join(c.text for c in one) == " w7 w8 w9 w10 "
    assert [t for c in many for t in c.model_extra["token_ids"]] == [t for c in one for t in c.model_extra["token_ids"]]
    assert many[-1].finish_reason == one[-1].finish_reason == "stop"


def test_an_interval_below_one_is_refused_by_name():
    with pytest.raises(StagemeshError, match="--stream-interval must be >= 1"):
        RouterConfig(M, stream_interval=0)
