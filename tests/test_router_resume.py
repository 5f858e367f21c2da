"""Streams outlive their router: with two routers over a replica, SIGKILL the one carrying 8 SSE streams and
8 stagemesh.client streams; every stream resumes on the other router (SSE: Last-Event-ID; the gRPC client by
itself) and ends with exactly the tokens and text it would have had. A client that does not resume gets its
error, and its request ends in the scheduler (at once, or at the end of the grace period when it asked for a
resumable stream). Real processes on loopback."""
from __future__ import annotations

import re
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from mesh import Mesh, Router
from parity import prompts
from sse_client import Streamed, stream
from stagemesh.client import Client
from stagemesh.v1 import scheduler_pb2
from tiny_models import greedy_tokens

pytestmark = pytest.mark.slow
NEW_TOKENS = 96
GRACE_S = 2
LONG = 1500  # tokens the non-resuming clients ask: about 3x what runs in the grace period (and the sweep) here


CHAT = "/v1/chat/completions"


def _chat_body(model_dir, prompt: list[int], stop) -> dict:
    return {"model": str(model_dir), "messages": [{"role": "user", "content": " ".join(f"w{t}" for t in prompt)}],
            "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True, "stream": True,
            "return_token_ids": True, **({"stop": stop} if stop else {})}


def _late_word(text: str) -> str:
    """A word of the text whose first appearance is well into it (a stop string met after the kill)."""
    words = text.split()
    return next(w for i, w in enumerate(words) if i >= 20 and w not in words[:i])


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir, tmp_path_factory):
    """The wide model (a step takes a few milliseconds) with room for LONG tokens: a request that asks for them
    outlasts the grace period even on a fast machine (500 tokens once finished inside 2s plus the sweep's 1s)."""
    from tiny_models import with_word_tokenizer

    wide = tiny_model_dir("llama", hidden_size=512, intermediate_size=2048, num_attention_heads=8,
                          max_position_embeddings=2048)
    return with_word_tokenizer(wide, tmp_path_factory.mktemp("wide_long") / "model")


def test_router_killed_under_16_streams_loses_none(model_dir, tmp_path):
    batch = prompts(384, (5, 40, 17, 70, 3, 33, 9, 51))
    want = greedy_tokens(model_dir, batch, NEW_TOKENS)
    body = lambda p: {"model": str(model_dir), "prompt": p, "max_tokens": NEW_TOKENS, "temperature": 0,  # noqa: E731
                      "ignore_eos": True, "stream": True, "return_token_ids": True}
    with Mesh(model_dir, [2, 2], log_dir=tmp_path, scheduler_args=(
            "--resume-grace-period", str(GRACE_S))) as mesh, \
            Router(model_dir, [mesh.address], log_dir=tmp_path, grpc_frontend=True) as b, \
            Router(model_dir, [mesh.address], log_dir=tmp_path, grpc_frontend=True) as a:
        undisturbed = [stream([b.base_url], "/v1/completions", body(p), f"u{i}") for i, p in enumerate(batch)]
        texts = [u.text for u in undisturbed]  # (the gRPC streams' undisturbed text)
        # half the SSE streams are chats that end at a stop string met after the kill: the resumed router
        # rebuilds the text and the stop string's state from the token ids
        chats = [_chat_body(model_dir, p, None) for p in batch[4:]]
        stops = [_late_word(stream([b.base_url], CHAT, c, f"w{i}").text) for i, c in enumerate(chats)]
        chats = [{**c, "stop": [s]} for c, s in zip(chats, stops)]
        undisturbed[4:] = [stream([b.base_url], CHAT, c, f"v{i}") for i, c in enumerate(chats)]
        urls = [a.base_url, b.base_url]
        progress = {}  # stream -> tokens read so far
        lock = threading.Lock()

        def sse(i: int) -> Streamed:
            def seen(out: Streamed) -> None:
                with lock:
                    progress[f"sse{i}"] = len(out.token_ids)
            if i >= 4:
                return stream(urls, CHAT, chats[i - 4], f"sse-{i}", on_event=seen)
            return stream(urls, "/v1/completions", body(batch[i]), f"sse-{i}", on_event=seen)

        def grpc(i: int):
            ids, text, reasons = [], "", []
            with Client([f"127.0.0.1:{a.grpc_port}", f"127.0.0.1:{b.grpc_port}"], timeout=120) as client:
                for reply in client.generate(batch[i], max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True,
                                             stream=True):
                    ids += reply.token_ids
                    text += reply.text
                    reasons += [reply.finish_reason] if reply.finish_reason else []
                    with lock:
                        progress[f"grpc{i}"] = len(ids)
            return ids, text, reasons

        openai_error = {}

        def plain(resumable: bool) -> None:  # a client that never resumes
            try:
                if resumable:  # it asks for event ids, but never uses them
                    with requests.post(a.base_url + "/v1/completions", json=body(batch[4]) | {"max_tokens": LONG},
                                       headers={"Accept": "text/event-stream"}, stream=True, timeout=60) as resp:
                        for _ in resp.iter_lines():
                            pass
                else:
                    for _ in a.client(timeout=60).completions.create(
                            model=str(model_dir), prompt=batch[4], max_tokens=LONG, temperature=0, stream=True,
                            extra_body={"ignore_eos": True}):
                        pass
            except Exception as err:  # noqa: BLE001 (the SDK raises httpx errors for a cut stream)
                openai_error[resumable] = err

        with ThreadPoolExecutor(18) as pool:
            sses = [pool.submit(sse, i) for i in range(8)]
            grpcs = [pool.submit(grpc, i) for i in range(8)]
            plains = [pool.submit(plain, r) for r in (False, True)]
            deadline = time.monotonic() + 60
            while sum(v >= 3 for v in progress.values()) < 16:
                assert time.monotonic() < deadline, f"the streams did not start: {progress}"
                time.sleep(0.01)
            a.proc.send_signal(signal.SIGKILL)
            killed_at = dict(progress)
            sse_results = [f.result(timeout=120) for f in sses]
            grpc_results = [f.result(timeout=120) for f in grpcs]
            for f in plains:
                f.result(timeout=60)
        assert all(v < NEW_TOKENS for v in killed_at.values()), killed_at  # every stream was cut mid-way
        for i in range(8):
            got = sse_results[i]
            assert got.done and got.resumes >= 1, f"SSE stream {i}"
            assert got.text == undisturbed[i].text and got.token_ids == undisturbed[i].token_ids, f"SSE stream {i}"
            if i < 4:
                assert got.token_ids == want[i] and got.finish_reasons == ["length"], f"SSE stream {i}"
            else:  # a chat that ended at its stop string, after the resume
                assert got.finish_reasons == ["stop"] and len(got.token_ids) > killed_at[f"sse{i}"], f"SSE {i}"
            assert all(event_id is not None for event_id in got.ids), got.ids
            ids, text, reasons = grpc_results[i]
            assert ids == want[i] and text == texts[i] and reasons == ["length"], f"gRPC stream {i}"
        assert set(openai_error) == {False, True}  # the non-resuming clients saw their stream break
        # their requests end: the plain one at once, the one that asked for a resumable stream after the grace
        deadline = time.monotonic() + GRACE_S + 10
        while (stats := mesh.stub.GetStats(scheduler_pb2.GetStatsRequest(), timeout=5)).num_running:
            assert time.monotonic() < deadline, "the unresumed requests still run"
            time.sleep(0.2)
        assert stats.num_waiting == 0
    log = (tmp_path / "scheduler.log").read_text()
    assert re.search(r"left unresumed for \d+s ended \(1 aborted", log), log[-3000:]
    assert not re.search(rf"finished: length, \d+ prompt \+ {LONG} output", log)  # neither ran to its end
    assert len(re.findall(r"request \S+ resumed", log)) == 16
