"""Background responses (background: true) through the official openai client: gateways in this process over a
slow fake replica (tests/fake_replicas.py: "w5" answers " w6 w7 ..."), on the memory store and on a Redis store
that two routers share; then a router SIGKILLed while its background response runs, which another router takes
over (a real mesh and router processes)."""
from __future__ import annotations

import asyncio
import signal
import time

import openai
import pytest
import requests

from fake_replicas import FakeReplica, FakeRouter
from mesh import Mesh, Router
from redis_server import INSTALLED, MISSING, RedisServer
from tiny_models import make_tiny_model, with_word_tokenizer

M = "fake-model"
needs_redis = pytest.mark.skipif(not INSTALLED, reason=MISSING)


class SlowReplica(FakeReplica):
    """Its first token after 0.3 s, then one every 20 ms: long enough to see a response queued and running.
    `streams`: every request's stream, to see which are still open (a cancel closes its stream: an abort)."""

    def submit(self, request):
        stream = super().submit(request)
        self.__dict__.setdefault("streams", []).append(stream)
        return stream

    def open_streams(self) -> int:
        return sum(not s.closed for s in self.__dict__.get("streams", []))

    async def _outputs(self, prompt, sampling, num_generated):
        await asyncio.sleep(0.3)
        async for out in super()._outputs(prompt, sampling, num_generated):
            await asyncio.sleep(0.02)
            yield out


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir, tmp_path_factory):
    return with_word_tokenizer(tiny_model_dir("llama"), tmp_path_factory.mktemp("background") / "tok")


def wait_status(client, response_id: str, wanted: set[str], timeout: float = 30):
    deadline = time.monotonic() + timeout
    seen = []
    while time.monotonic() < deadline:
        r = client.responses.retrieve(response_id)
        if not seen or seen[-1] != r.status:
            seen.append(r.status)
        if r.status in wanted:
            return r, seen
        time.sleep(0.02)
    raise TimeoutError(f"{response_id} still {seen[-1]} after {timeout}s")


def test_queued_in_progress_completed_with_the_foreground_text(model_dir):
    with FakeRouter(model_dir, M, replica_class=SlowReplica) as router:
        client = router.client()
        fore = client.responses.create(model=M, input="w5", max_output_tokens=6)
        back = client.responses.create(model=M, input="w5", max_output_tokens=6, background=True)
        assert back.status == "queued" and back.background is True and back.output == []
        done, seen = wait_status(client, back.id, {"completed", "incomplete", "failed"})
        assert seen[0] == "queued" and "in_progress" in seen, seen
        assert done.status == fore.status and done.output_text == fore.output_text == " w6 w7 w8 w9 w10 w11"
        assert done.usage.output_tokens == 6
        with pytest.raises(openai.BadRequestError, match="Cannot cancel a synchronous response"):
            client.responses.cancel(back.id)  # (finished: vLLM's words)
        with pytest.raises(openai.BadRequestError, match="background can only be used when `store` is true"):
            client.responses.create(model=M, input="w5", background=True, store=False)


def test_cancel_stops_the_generation(model_dir):
    with FakeRouter(model_dir, M, replica_class=SlowReplica) as router:
        client = router.client()
        back = client.responses.create(model=M, input="w5", max_output_tokens=400, background=True)
        wait_status(client, back.id, {"in_progress"})
        cancelled = client.responses.cancel(back.id)
        assert cancelled.status == "cancelled"
        time.sleep(0.3)
        assert client.responses.retrieve(back.id).status == "cancelled"
        assert router.replica.open_streams() == 0  # its request was aborted on the replica


def test_a_background_stream_is_read_again_from_starting_after(model_dir):
    """A client reads part of a background stream, goes away, and reads on with starting_after: every event once,
    in order, the text whole."""
    with FakeRouter(model_dir, M, replica_class=SlowReplica) as router:
        client = router.client()
        first = []
        with client.responses.create(model=M, input="w5", max_output_tokens=8, background=True, stream=True) as s:
            for event in s:
                first.append(event)
                if event.type == "response.output_text.delta":
                    break  # the client goes away mid-answer
        rid = first[0].response.id
        assert first[0].type == "response.created" and first[0].response.status == "queued"
        rest = list(client.responses.retrieve(rid, stream=True, starting_after=first[-1].sequence_number))
        events = first + rest
        assert [e.sequence_number for e in events] == list(range(len(events)))
        assert events[-1].type == "response.incomplete"  # (cut at max_output_tokens)
        text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert text == events[-1].response.output_text == " w6 w7 w8 w9 w10 w11 w12 w13"
        again = list(client.responses.retrieve(rid, stream=True, starting_after=2))
        assert [e.sequence_number for e in again] == list(range(3, len(events)))
        with pytest.raises(openai.BadRequestError, match="read again with GET"):  # (not a foreground resume)
            client.responses.create(model=M, input="w5", background=True, stream=True,
                                    extra_headers={"Last-Event-ID": "3", "X-Request-Id": "r1"})


@needs_redis
def test_any_router_polls_and_cancels_a_background_response(model_dir, tmp_path):
    server = RedisServer(tmp_path)
    server.start()
    try:
        url = server.url
        with FakeRouter(model_dir, M, replica_class=SlowReplica, responses_store=url) as a, \
                FakeRouter(model_dir, M, replica_class=SlowReplica, responses_store=url) as b:
            done = a.client().responses.create(model=M, input="w5", max_output_tokens=3, background=True)
            finished, _ = wait_status(b.client(), done.id, {"completed", "incomplete"})
            assert finished.output_text == " w6 w7 w8"
            long = a.client().responses.create(model=M, input="w5", max_output_tokens=400, background=True)
            wait_status(b.client(), long.id, {"in_progress"})
            assert b.client().responses.cancel(long.id).status == "cancelled"
            deadline = time.monotonic() + 5
            while a.replica.open_streams() and time.monotonic() < deadline:  # A sees the cancel and aborts
                time.sleep(0.05)
            assert a.replica.open_streams() == 0
            assert a.client().responses.retrieve(long.id).status == "cancelled"
    finally:
        server.stop()


@pytest.mark.slow
@needs_redis
def test_a_background_response_outlives_the_router_that_took_it(tmp_path):
    """Router A takes a background response and is SIGKILLed while it runs; polling router B takes it over (A's
    lease expired), attaching the request its replica kept: it completes with the foreground's text."""
    model = with_word_tokenizer(make_tiny_model(tmp_path / "raw", "llama"), tmp_path / "model")
    server = RedisServer(tmp_path)
    server.start()
    store = ("--responses-store", server.url)
    try:
        with Mesh(model, [4], log_dir=tmp_path) as mesh, \
                Router(model, [mesh.address], extra=store, log_dir=tmp_path) as a, \
                Router(model, [mesh.address], extra=store, log_dir=tmp_path) as b:
            body = dict(model=str(model), input="w5 w6", max_output_tokens=300, temperature=0,
                        extra_body={"ignore_eos": True})
            fore = b.client().responses.create(**body)
            back = a.client(timeout=60).responses.create(background=True, **body)
            wait_status(b.client(), back.id, {"in_progress"})
            a.proc.send_signal(signal.SIGKILL)
            a.proc.wait()
            done, _ = wait_status(b.client(timeout=60), back.id, {"completed", "incomplete", "failed"}, timeout=120)
            assert done.status == fore.status and done.output_text == fore.output_text
            assert requests.get(f"{b.base_url}/v1/responses/{back.id}", timeout=10).json()["background"] is True
    finally:
        server.stop()
