"""Gateway work that cannot block the gateway: texts are tokenized on more than one thread, so that one
slow text does not queue the others behind it, and a chat template's output is bounded in size. The gateway is
the router's app in this process over a fake replica (tests/fake_replicas.py; word tokenizer: "w5 w6" is
[5, 6], the fake replica answers the prompt's last token + 1, + 2, ...)."""
from __future__ import annotations

import asyncio
import shutil
import threading
import time
from pathlib import Path

import pytest
import requests

from fake_replicas import FakeRouter
from tiny_models import with_word_tokenizer

M = "fake-model"
MSG = [{"role": "user", "content": "w5 w6"}]


@pytest.fixture(scope="module")
def model(tiny_model_dir, tmp_path_factory):
    return with_word_tokenizer(tiny_model_dir("llama"), tmp_path_factory.mktemp("bounds") / "tok")


def chat(router, template: str | None = None, path: str = "/v1/chat/completions", **body) -> requests.Response:
    body = {"model": M, "messages": MSG, "max_tokens": 2, **body}
    if template is not None:
        body["chat_template"] = template
    return requests.post(router.base_url + path, json=body, timeout=60)


def error_of(resp: requests.Response, status: int = 400) -> dict:
    assert resp.status_code == status, resp.text
    return resp.json()["error"]


def test_one_slow_text_does_not_queue_the_others_behind_it(model):
    from router.tokenization import Tokenizer

    tokenizer = Tokenizer(model, 512)
    release = threading.Event()

    async def both() -> float:
        slow = asyncio.ensure_future(tokenizer.run(release.wait, 5))
        await asyncio.sleep(0.1)  # it holds a thread
        start = time.perf_counter()
        assert await tokenizer.run(tokenizer.encode, "w5 w6", False) == [5, 6]
        took = time.perf_counter() - start
        release.set()
        await slow
        return took

    try:
        assert asyncio.run(both()) < 1.0
    finally:
        release.set()


def _model_with_template(model: Path, target: Path, template: str) -> Path:
    from transformers import AutoTokenizer

    shutil.copytree(model, target)
    tok = AutoTokenizer.from_pretrained(model)
    tok.chat_template = template
    tok.save_pretrained(target)
    return target


def test_the_models_own_template_is_bounded_in_size_too(model, tmp_path):
    bomb = _model_with_template(model, tmp_path / "bomb", "{% for i in range(2000) %}{{ 'w5 ' * 1000 }}{% endfor %}")
    with FakeRouter(bomb, M) as router:
        error = error_of(chat(router))
        assert error["param"] == "messages" and "wrote more than 2,560 characters" in error["message"], error
        assert not router.replica.submitted
