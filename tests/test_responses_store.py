"""The Responses API's store on a real redis-server that several routers share (--responses-store redis://...):
gateways in this process over fake replicas (tests/fake_replicas.py: word tokenizer, "w5 w6" is [5, 6]; the
replica answers the prompt's last token + 1, + 2, ...), and one `stagemesh router` process for its start-up.
The memory store, the default, is tests/test_responses_api.py's."""
from __future__ import annotations

import json
import logging
import socket
import subprocess
import sys
import time

import openai
import pytest
import requests

from fake_replicas import FakeRouter
from redis_server import INSTALLED, MISSING, RedisServer, free_port
from router.responses_api.store_flags import check_store_options
from tiny_models import with_word_tokenizer

M = "fake-model"
needs_redis = pytest.mark.skipif(not INSTALLED, reason=MISSING)


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir, tmp_path_factory):
    return with_word_tokenizer(tiny_model_dir("llama"), tmp_path_factory.mktemp("store") / "tok")


@pytest.fixture
def redis_server(tmp_path):
    server = RedisServer(tmp_path)
    server.start()
    yield server
    server.stop()


def prompt(router) -> list[int]:
    return router.replica.submitted[-1][1]


@needs_redis
def test_a_response_made_on_one_router_is_read_chained_and_deleted_on_another(model_dir, redis_server):
    url = redis_server.url
    with FakeRouter(model_dir, M, responses_store=url) as a, FakeRouter(model_dir, M, responses_store=url) as b:
        first = a.client().responses.create(model=M, instructions="w30", input="w5", max_output_tokens=2)
        assert first.store is True and b.client().responses.retrieve(first.id).output_text == first.output_text
        second = b.client().responses.create(model=M, previous_response_id=first.id, input="w9", max_output_tokens=2)
        assert prompt(b) == [5, 6, 7, 9]  # A's input and answer, then B's input (instructions do not carry over)
        with a.client().responses.stream(model=M, previous_response_id=second.id, input="w40", max_output_tokens=3,
                                         extra_body={"stop": [" w42"]}) as s:  # (completed: the SDK's final)
            third = s.get_final_response()
        assert prompt(a) == [5, 6, 7, 9, 10, 11, 40]
        assert b.client().responses.retrieve(third.id).output_text == third.output_text == " w41"
        # JSON under a namespaced key, with the default TTL
        kept = redis_server.client()
        assert json.loads(kept.get(f"stagemesh:responses:{first.id}"))["body"]["id"] == first.id
        assert 3_590_000 < kept.pttl(f"stagemesh:responses:{first.id}") <= 3_600_000
        b.client().responses.delete(first.id)
        with pytest.raises(openai.NotFoundError) as err:
            a.client().responses.retrieve(first.id)
        assert "--responses-store-ttl" in err.value.body["message"]
        with pytest.raises(openai.NotFoundError):
            a.client().responses.delete(first.id)


@needs_redis
def test_entries_expire_after_the_ttl(model_dir, redis_server):
    with FakeRouter(model_dir, M, responses_store=redis_server.url, responses_store_ttl=0.5) as r:
        client = r.client()
        out = client.responses.create(model=M, input="w5", max_output_tokens=1)
        assert client.responses.retrieve(out.id).id == out.id
        time.sleep(0.7)
        with pytest.raises(openai.NotFoundError) as err:
            client.responses.retrieve(out.id)
        assert "has expired (responses are kept 0.5 s, --responses-store-ttl)" in err.value.body["message"]
        with pytest.raises(openai.NotFoundError) as err:
            client.responses.create(model=M, previous_response_id=out.id, input="w5")
        assert err.value.body["param"] == "previous_response_id"


def _unavailable(call, name: str) -> None:
    with pytest.raises(openai.InternalServerError) as err:
        call()
    assert err.value.status_code == 503 and err.value.response.headers["Retry-After"] == "1"
    message = err.value.body["message"]
    assert f"response store {name} (--responses-store) is unavailable" in message, message


@needs_redis
def test_a_stopped_store_is_a_503_naming_it_while_chat_and_completions_go_on_and_it_comes_back(model_dir,
                                                                                              redis_server, caplog):
    caplog.set_level(logging.INFO, "stagemesh.router")
    url = redis_server.url
    with FakeRouter(model_dir, M, responses_store=url) as r:
        client = r.client()
        first = client.responses.create(model=M, input="w5", max_output_tokens=1)
        redis_server.kill()
        _unavailable(lambda: client.responses.retrieve(first.id), url)
        _unavailable(lambda: client.responses.delete(first.id), url)
        _unavailable(lambda: client.responses.create(model=M, previous_response_id=first.id, input="w9"), url)
        chat = client.chat.completions.create(model=M, messages=[{"role": "user", "content": "w5"}], max_tokens=2)
        assert chat.choices[0].message.content == " w6 w7"
        assert client.completions.create(model=M, prompt="w5", max_tokens=2).choices[0].text == " w6 w7"
        # a store: true response is answered all the same, saying it was not stored (whole and streamed)
        assert client.responses.create(model=M, input="w5", max_output_tokens=1).store is False
        with client.responses.stream(model=M, input="w5", max_output_tokens=3, extra_body={"stop": [" w7"]}) as s:
            assert s.get_final_response().store is False
        logged = [r.getMessage() for r in caplog.records]
        assert sum(f"the response store {url} is unavailable" in m for m in logged) == 1  # when it went down
        assert sum("is answered unstored (\"store\": false)" in m for m in logged) == 2
        redis_server.start()  # on the same port, empty: the same router uses it again
        again = client.responses.create(model=M, input="w5", max_output_tokens=1)
        assert again.store is True and client.responses.retrieve(again.id).id == again.id
        assert f"the response store {url} answers again" in caplog.text
        client.responses.create(model=M, previous_response_id=again.id, input="w9", max_output_tokens=1)
        assert prompt(r) == [5, 6, 9]
        with pytest.raises(openai.NotFoundError):  # gone with the server that held it
            client.responses.retrieve(first.id)
        redis_server.kill()  # and back before any request saw it down: the pooled connections are stale
        redis_server.start()
        again = client.responses.create(model=M, input="w5", max_output_tokens=1)
        assert again.store is True and client.responses.retrieve(again.id).id == again.id


def test_a_hung_store_answers_503_within_its_timeout_and_never_shows_its_password(model_dir):
    with socket.socket() as hung:  # accepts connections (the kernel's backlog) and never answers
        hung.bind(("127.0.0.1", 0))
        hung.listen(8)
        port = hung.getsockname()[1]
        url = f"redis://:s3cret@127.0.0.1:{port}/0?socket_timeout=0.3&socket_connect_timeout=0.3"
        with FakeRouter(model_dir, M, responses_store=url) as r:
            start = time.monotonic()
            resp = requests.get(f"{r.base_url}/v1/responses/resp_1", timeout=10)
            assert resp.status_code == 503 and time.monotonic() - start < 2
            message = resp.json()["error"]["message"]
            assert f"redis://127.0.0.1:{port}/0 (--responses-store)" in message and "s3cret" not in message
            chat = r.client().chat.completions.create(model=M, messages=[{"role": "user", "content": "w5"}],
                                                      max_tokens=1)
            assert chat.choices[0].message.content == " w6"
            spec = requests.get(f"{r.base_url}/openapi.json", timeout=10).json()
            assert "503" in spec["paths"]["/v1/responses/{response_id}"]["get"]["responses"]


@needs_redis
def test_a_value_that_is_not_a_stored_response_is_a_500_naming_its_key(model_dir, redis_server):
    redis_server.client().set("stagemesh:responses:resp_other", b"\x80 not json")
    with FakeRouter(model_dir, M, responses_store=redis_server.url) as r:
        resp = requests.get(f"{r.base_url}/v1/responses/resp_other", timeout=10)
    assert resp.status_code == 500, resp.text
    assert "holds an unreadable value under 'stagemesh:responses:resp_other'" in resp.json()["error"]["message"]


@pytest.mark.parametrize("spec,size,ttl,words", [
    ("memcached://h:1", None, None, "--responses-store must be 'memory' or a Redis URL"),
    ("memory", None, 60.0, "--responses-store-ttl applies to a redis store"),
    ("memory", 0, None, "--responses-store-size must be >= 1"),
    ("redis://h:6379/0", 10, None, "--responses-store-size bounds the memory store"),
    ("redis://h:6379/0", None, 0.0, "--responses-store-ttl must be > 0"),
    ("redis://:pw@h:port/0", None, None, "--responses-store redis://h:port/0: Port could not be cast"),
    ("redis://h/0?sockettimeout=1", None, None, "unexpected keyword argument 'sockettimeout'"),
])
def test_store_options_that_do_not_go_together_are_refused_by_name(spec, size, ttl, words):
    with pytest.raises(ValueError) as err:
        check_store_options(spec, size, ttl)
    assert words in str(err.value)


@needs_redis
def test_the_router_starts_before_its_store_and_uses_it_once_it_is_up(model_dir, tmp_path):
    """A `stagemesh router` process: its start-up log names the store, one not up yet is retried per request."""
    server = RedisServer(tmp_path)
    port = free_port()
    log = tmp_path / "router.log"
    argv = [sys.executable, "-m", "stagemesh", "router", str(model_dir), "--port", str(port), "--replica",
            f"127.0.0.1:{free_port()}", "--responses-store", server.url, "--responses-store-ttl", "60"]
    with open(log, "wb") as out:
        router = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    try:
        _wait_for(lambda: "router serving" in log.read_text(), router, log)
        assert f"Responses API store: {server.url} is not reachable yet" in log.read_text()
        missing = f"http://127.0.0.1:{port}/v1/responses/resp_1"
        assert requests.get(missing, timeout=10).status_code == 503
        server.start()
        resp = requests.get(missing, timeout=10)
        assert resp.status_code == 404 and "kept 60 s" in resp.json()["error"]["message"]
        _wait_for(lambda: f"the response store {server.url} answers again" in log.read_text(), router, log)
    finally:
        router.terminate()
        router.wait(10)
        server.stop()


def _wait_for(ready, proc: subprocess.Popen, log, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"the router's log did not show what was awaited (exit {proc.poll()}): "
                                 f"{log.read_text()[-2000:]}")
        time.sleep(0.1)
