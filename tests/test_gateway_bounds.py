"""Gateway work that cannot block the gateway: a request's own chat_template is refused unless the router
trusts them (--trust-request-chat-template); trusted, it renders in a worker process that is killed past the
time bound (or when its client leaves) while every other stream and /health go on; a template's output is
bounded in size; and the render is transformers' own, byte for byte. The gateway is the router's app in this
process over a fake replica (tests/fake_replicas.py; word tokenizer: "w5 w6" is [5, 6], the fake replica
answers the prompt's last token + 1, + 2, ...); its template workers are real processes."""
from __future__ import annotations

import asyncio
import http.client
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

from fake_replicas import FakeRouter
from router.template_pool import pool_size
from tiny_models import with_word_tokenizer

M = "fake-model"
MSG = [{"role": "user", "content": "w5 w6"}]
# 10^10 iterations that print nothing: only the time bound stops it
NESTED_LOOPS = "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}"
# prints 300 MB, 3 kB at a time: the size bound stops it at the first chunks
PRINTS_WITHOUT_END = "{% for i in range(100000) %}{{ 'w5 ' * 1000 }}{% endfor %}"
TIMEOUT_S = 2.0
WORKERS = pool_size()


@pytest.fixture(scope="module")
def model(tiny_model_dir, tmp_path_factory):
    return with_word_tokenizer(tiny_model_dir("llama"), tmp_path_factory.mktemp("bounds") / "tok")


@pytest.fixture(scope="module")
def trusted(model):
    others = template_workers()
    with FakeRouter(model, M, trust_request_chat_template=True, chat_template_timeout=TIMEOUT_S) as r:
        r.workers = lambda: template_workers() - others  # its own
        yield r
    assert _wait_for(lambda: not template_workers() - others, 5), "the router left template workers behind"


def template_workers() -> set[int]:
    """This process's living `python -m router.template_process` children (a zombie is not living)."""
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            state, ppid = (entry / "stat").read_text().rsplit(")", 1)[1].split()[:2]
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if int(ppid) == os.getpid() and state != "Z" and b"router.template_process" in cmdline:
            found.add(int(entry.name))
    return found


def _wait_for(condition, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def chat(router, template: str | None = None, path: str = "/v1/chat/completions", **body) -> requests.Response:
    body = {"model": M, "messages": MSG, "max_tokens": 2, **body}
    if template is not None:
        body["chat_template"] = template
    return requests.post(router.base_url + path, json=body, timeout=60)


def error_of(resp: requests.Response, status: int = 400) -> dict:
    assert resp.status_code == status, resp.text
    return resp.json()["error"]


def test_a_request_chat_template_is_refused_unless_the_router_trusts_them(model):
    others = template_workers()
    with FakeRouter(model, M) as router:
        harmless = "{{ messages[0]['content'] }}"
        # (the harmless one first: today's gateway would render the hostile one for hours)
        for template, path in [(harmless, "/v1/chat/completions"), (harmless, "/tokenize"),
                               (NESTED_LOOPS, "/v1/chat/completions"), (NESTED_LOOPS, "/tokenize")]:
            error = error_of(chat(router, template, path))
            assert error["param"] == "chat_template" and "--trust-request-chat-template" in error["message"], error
        responses = requests.post(router.base_url + "/v1/responses", timeout=30,
                                  json={"model": M, "input": "w5", "chat_template": harmless})
        assert error_of(responses)["param"] == "chat_template"
        assert chat(router).status_code == 200  # the model's own template serves
        assert router.replica.submitted and not template_workers() - others  # (no worker without the flag)


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


def _stream(router, i: int) -> tuple[str, str, float]:
    """A streamed chat of prompt [10 + i]: (its text, its finish reason, when it ended)."""
    body = {"model": M, "messages": [{"role": "user", "content": f"w{10 + i}"}], "max_tokens": 8, "stream": True}
    text, reason = "", None
    with requests.post(router.base_url + "/v1/chat/completions", json=body, stream=True, timeout=30) as resp:
        assert resp.status_code == 200, resp.text
        for line in resp.iter_lines():
            if line.startswith(b"data: {"):
                choice = json.loads(line[6:])["choices"][0]
                text += choice["delta"].get("content") or ""
                reason = choice["finish_reason"] or reason
    return text, reason, time.monotonic()


@pytest.mark.slow  # starts the template workers
def test_a_nested_loop_template_is_killed_at_the_bound_while_the_gateway_serves(trusted):
    assert _wait_for(lambda: len(trusted.workers()) == WORKERS, 30)
    before = trusted.workers()
    with ThreadPoolExecutor(10) as pool:
        start = time.monotonic()
        hostile = pool.submit(chat, trusted, NESTED_LOOPS)
        time.sleep(0.3)  # it is rendering
        streams = [pool.submit(_stream, trusted, i) for i in range(8)]
        health = []
        while not hostile.done():
            t = time.perf_counter()
            assert requests.get(trusted.base_url + "/health", timeout=5).status_code == 200
            health.append(time.perf_counter() - t)
            time.sleep(0.05)
        ended = time.monotonic()
        results = [s.result() for s in streams]
    error = error_of(hostile.result())
    assert error["param"] == "chat_template" and f"more than {TIMEOUT_S:g} s" in error["message"]
    assert "--chat-template-timeout" in error["message"] and TIMEOUT_S <= ended - start < TIMEOUT_S + 3
    for i, (text, reason, done) in enumerate(results):  # each correct, and done while the template ran
        assert text == "".join(f" w{t}" for t in range(11 + i, 19 + i)) and reason == "length" and done < ended
    assert health and max(health) < 1.0, max(health)
    print(f"/health while the template ran: {len(health)} probes, max {max(health) * 1e3:.1f} ms")
    # its worker was SIGKILLed (and reaped), and a new one took its place
    assert _wait_for(lambda: len(trusted.workers()) == WORKERS and len(before - trusted.workers()) == 1, 30)
    killed = before - trusted.workers()
    # reaped: gone from /proc (asyncio's child watcher may take a moment on a loaded machine)
    assert _wait_for(lambda: all(not Path(f"/proc/{pid}").exists() for pid in killed), 10)


@pytest.mark.slow
def test_a_template_that_prints_without_end_is_stopped_at_the_size_bound(trusted):
    assert _wait_for(lambda: len(trusted.workers()) == WORKERS, 30)
    before = trusted.workers()
    start = time.monotonic()
    error = error_of(chat(trusted, PRINTS_WITHOUT_END))
    assert time.monotonic() - start < TIMEOUT_S  # stopped by its size, not by the clock
    assert error["param"] == "chat_template" and "wrote more than 2,560 characters" in error["message"], error
    assert trusted.workers() == before  # the worker stopped the render itself, and stays


@pytest.mark.slow
def test_a_template_that_builds_a_huge_string_meets_the_workers_memory_limit(trusted):
    error = error_of(chat(trusted, "{% set x = 'w5 ' * 1000000000 %}{{ x | length }}"))
    assert error["param"] == "chat_template" and "MiB of memory" in error["message"], error
    broken = error_of(chat(trusted, "{% for %}"))  # and the template's own error is still the client's 400
    assert broken["param"] == "messages" and "the chat template could not render" in broken["message"]


@pytest.mark.slow
def test_a_client_that_leaves_stops_its_render(model):
    others = template_workers()  # (another router's, a module fixture's)
    with FakeRouter(model, M, trust_request_chat_template=True, chat_template_timeout=60) as router:
        mine = lambda: template_workers() - others  # noqa: E731
        assert _wait_for(lambda: len(mine()) == WORKERS, 30)
        before = mine()
        conn = http.client.HTTPConnection("127.0.0.1", int(router.base_url.rsplit(":", 1)[1]), timeout=10)
        conn.request("POST", "/tokenize", json.dumps({"messages": MSG, "chat_template": NESTED_LOOPS}),
                     {"Content-Type": "application/json"})
        time.sleep(0.5)
        conn.close()  # long before the 60 s bound
        assert _wait_for(lambda: len(before - mine()) == 1, 5), "the render outlived its client"
        assert _wait_for(lambda: len(mine()) == WORKERS, 30)
    assert _wait_for(lambda: not mine(), 5)


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


TOOLS_TEMPLATE = (  # tools, documents, kwargs, special tokens, tojson, namespace and loop controls
    "{{ bos_token }}{% set ns = namespace(n=0) %}{% for t in tools or [] %}<tool>{{ t | tojson }}</tool>\n{% endfor %}"
    "{% for d in documents or [] %}[{{ d.title }}] {{ d.text }}\n{% endfor %}"
    "{% for m in messages %}{% if m.role == 'tool' %}{% continue %}{% endif %}{% set ns.n = ns.n + 1 %}"
    "<|im_start|>{{ m.role }} {{ ns.n }}\n{{ m.content }}{% if m.tool_calls %}{{ m.tool_calls | tojson }}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if flag %}{{ flag }}{% endif %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% endif %}")
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}}}}}
CONVERSATION = [{"role": "system", "content": "Be brief. \u00e9\U0001F680 \ud800"},
                {"role": "user", "content": "What's the weather in Paris?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "P"}}}]},
                {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
                {"role": "assistant", "content": "It is sunny"}]


@pytest.mark.slow  # loads the default model's tokenizer
def test_a_trusted_request_template_renders_what_apply_chat_template_renders(default_model_dir):
    from transformers import AutoTokenizer

    from router.request import ChatOptions
    from router.tokenization import Tokenizer

    tok = AutoTokenizer.from_pretrained(default_model_dir)
    cases = [(tok.chat_template, {}), (tok.chat_template, {"add_generation_prompt": False,
                                                            "continue_final_message": True}),
             (TOOLS_TEMPLATE, {"tools": [TOOL], "documents": [{"title": "t", "text": "d"}], "flag": "on"})]
    others = template_workers()  # (a module fixture's)
    tokenizer = Tokenizer(default_model_dir, 8192, template_timeout_s=10)

    async def render_all() -> list[str]:
        await tokenizer.start()
        try:
            out = []
            for template, options in cases:
                options = dict(options)
                documents, generation = options.pop("documents", None), options.pop("add_generation_prompt", True)
                final = options.pop("continue_final_message", False)
                out.append(await tokenizer.render_chat(ChatOptions(CONVERSATION, generation, final, template,
                                                                   options, documents)))
            return out
        finally:
            await tokenizer.close()

    for (template, options), text in zip(cases, asyncio.run(render_all())):
        expected = tok.apply_chat_template(CONVERSATION, chat_template=template, tokenize=False,
                                           **{"add_generation_prompt": True, **options})
        assert text == expected
    assert not template_workers() - others


@pytest.mark.slow
def test_the_cpu_limit_ends_a_render_the_router_did_not_stop():
    job = {"template": NESTED_LOOPS, "messages": MSG, "tools": None, "documents": None, "add_generation_prompt": True,
           "continue_final_message": False, "kwargs": {}, "max_chars": 1000, "cpu_seconds": 1}
    worker = subprocess.Popen([sys.executable, "-m", "router.template_process"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert json.loads(worker.stdout.readline()) == {"ready": True}
        worker.stdin.write(json.dumps(job) + "\n")
        worker.stdin.flush()
        assert worker.wait(timeout=20) == -signal.SIGXCPU
    finally:
        if worker.poll() is None:
            worker.kill()
        worker.wait()
