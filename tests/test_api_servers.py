"""One `stagemesh serve` with the processes a deployment adds (a single start for the checks that need them):
--api-server-count 2 routers on one port (SO_REUSEPORT), a prefill replica and two decode replicas (-dp 3
--prefill-replicas 1), the Responses API's store in Redis, nginx in front. In order:

- every scrape of /metrics, whichever router answers, counts every router's requests;
- a stream's logprobs survive a continuation (its replica SIGKILLed) and then its router's death: the resumed
  stream sends what the undisturbed one sends;
- a Responses API stream resumes after its router's SIGKILL, token-exact, with the same headers; another client's
  key gets a 404; no counter went back across the router's restart;
- a SIGKILL to serve under load (through nginx) leaves none of its processes alive.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import grpc
import pytest
import requests

from mesh import free_port
from ops_mesh import Load, Serve, alive, metrics_dirs, scrape
from parity import prompts
from sse_client import events
from tiny_models import reference_model, reference_tokens, with_word_tokenizer

from stagemesh.core import internal_token
from stagemesh.v1 import scheduler_pb2, scheduler_pb2_grpc

pytestmark = pytest.mark.slow
M = "m"
TEMPLATE = Path(__file__).parents[1] / "deploy" / "nginx" / "stagemesh-lb.conf.template"
LONG = 240  # tokens of the streams a kill cuts (the wide model: a few ms a step)
TOKEN = "api-servers-test-token"  # the mesh's internal token (--internal-token-file): the tests ask schedulers too


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir, tmp_path_factory):
    wide = tiny_model_dir("llama", hidden_size=512, intermediate_size=2048, num_attention_heads=8,
                          max_position_embeddings=1024)
    return with_word_tokenizer(wide, tmp_path_factory.mktemp("api-servers") / "model")


@pytest.fixture(scope="module")
def serve(model_dir, tmp_path_factory):
    from redis_server import INSTALLED, MISSING, RedisServer

    if not INSTALLED:
        pytest.skip(MISSING)
    logs = tmp_path_factory.mktemp("serve")
    store = RedisServer(logs)
    store.start()
    (logs / "token").write_text(TOKEN)
    mesh = Serve(model_dir, logs, "--internal-token-file", str(logs / "token"),
                 "--api-server-count", "2", "-dp", "3", "--prefill-replicas", "1",
                 "--responses-store", store.url, "--served-model-name", M, "--resume-grace-period", "30",
                 "--shutdown-timeout", "2")
    try:
        mesh.wait_ready(3)
        yield mesh
    finally:
        if mesh.proc.poll() is None:
            mesh.stop()
        store.stop()


def success_total(base_url: str) -> float:
    return sum(v for k, v in scrape(base_url).items() if k.startswith("vllm:request_success_total"))


def test_every_scrape_through_either_router_counts_every_routers_requests(serve):
    body = {"model": M, "prompt": "w5 w6 w7", "max_tokens": 4, "ignore_eos": True}
    for i in range(10):  # (a connection each: the kernel spreads them over the two routers)
        resp = requests.post(f"{serve.base_url}/v1/completions", json={**body, "prompt": f"w5 w{i + 6}"}, timeout=60)
        assert resp.status_code == 200, resp.text
    assert [success_total(serve.base_url) for _ in range(6)] == [10.0] * 6


# -- streams cut by a replica's and a router's death ----------------------------------------------------

def _read(resp: requests.Response, limit: int | None = None) -> list[tuple[str | None, dict]]:
    """(id, JSON) of a stream's events, up to `limit` of them or to its end. The response keeps one reader of its
    lines, so that a stream read in parts stays open in between (a client that stops reading for a while; closing
    the reader would close the connection, and a router aborts a request whose client left)."""
    if not hasattr(resp, "events_"):
        resp.events_ = events(resp.iter_lines())  # type: ignore[attr-defined]
    out = []
    for event in resp.events_:  # type: ignore[attr-defined]
        if event.data == "[DONE]":
            break
        out.append((event.id, json.loads(event.data)))
        if limit is not None and len(out) >= limit:
            break
    return out


def _client_port(resp: requests.Response) -> int:
    """The local port of a response's connection (taken before its body is read: urllib3 lets go of it then)."""
    return resp.raw._fp.fp.raw._sock.getsockname()[1]


def _holder(serve: Serve, client_port: int) -> int:
    """The pid of the router holding the connection from this local port (the routers share a port)."""
    inode = None
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            fields = line.split()
            local, remote = (int(a.split(":")[1], 16) for a in fields[1:3])
            if local == serve.port and remote == client_port:
                inode = fields[9]
    assert inode is not None, "no router holds the connection"
    for name in ("router[0]", "router[1]"):
        pid = serve.pid(name)
        if any(os.readlink(f"/proc/{pid}/fd/{fd}") == f"socket:[{inode}]" for fd in os.listdir(f"/proc/{pid}/fd")):
            return pid
    raise AssertionError("neither router holds the connection")


def _kill_router(serve: Serve, pid: int) -> None:
    """SIGKILL a router and wait until serve started it again and it listens (it joins the shared port only once
    a replica serves: until then the other router alone takes every connection)."""
    listening = serve.text().count("router serving")
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 120
    while serve.text().count("router serving") == listening:
        assert time.monotonic() < deadline, "serve did not start the router again"
        time.sleep(0.1)


def _logprobs(chunks: list[dict]) -> list[tuple[int, float]]:
    out = []
    for chunk in chunks:
        for choice in chunk.get("choices", []):
            lp = choice.get("logprobs") or {}
            out += [(t, v) for t, v in zip(choice.get("token_ids") or [], lp.get("token_logprobs") or [])]
    return out


def test_logprobs_survive_a_continuation_and_then_a_router_death(serve, model_dir):
    """A completion stream with logprobs: its decode replica SIGKILLed mid-way (the router continues it on
    another replica, with the tokens streamed so far), then its router SIGKILLed while the client lags behind
    the tokens that moved; the resumed stream replays them from the new replica's journal with their logprobs:
    every token with its logprob, as the undisturbed stream sent them."""
    prompt = prompts(384, (24,))[0]
    want = reference_tokens(reference_model(model_dir), prompt, LONG)
    body = {"model": M, "prompt": prompt, "max_tokens": LONG, "temperature": 0, "ignore_eos": True, "stream": True,
            "logprobs": 1, "return_token_ids": True}
    head = {"Accept": "text/event-stream"}
    with requests.post(f"{serve.base_url}/v1/completions", json=body, headers={**head, "X-Request-Id": "u-1"},
                       stream=True, timeout=120) as resp:
        undisturbed = _logprobs([c for _, c in _read(resp)])
    assert [t for t, _ in undisturbed] == want
    with requests.post(f"{serve.base_url}/v1/completions", json=body, headers={**head, "X-Request-Id": "c-1"},
                       stream=True, timeout=120) as resp:
        client_port = _client_port(resp)
        have = _read(resp, limit=10)  # then the client stops reading: it lags while the stream goes on
        router = _holder(serve, client_port)
        running = _decode_replica_running(serve)
        os.kill(running, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while "c-1: replica" not in serve.text():  # (the router's line: continuing it on another replica)
            assert time.monotonic() < deadline, serve.text()[-3000:]
            time.sleep(0.05)
        time.sleep(0.3)  # (tokens on the new replica too)
        _kill_router(serve, router)
    last = next(i for i, _ in reversed(have) if i is not None)
    with requests.post(f"{serve.base_url}/v1/completions", json=body, stream=True, timeout=120,
                       headers={**head, "X-Request-Id": "c-1", "Last-Event-ID": last}) as resp:
        assert resp.status_code == 200, resp.text + "\n" + serve.text()[-4000:]
        rest = _read(resp)
    got = _logprobs([c for _, c in have + rest])
    assert [t for t, _ in got] == want
    assert all(abs(a[1] - b[1]) < 1e-3 for a, b in zip(got, undisturbed)), (got[:5], undisturbed[:5])


def _decode_replica_running(serve: Serve) -> int:
    """The pid of the scheduler of the decode replica that runs a request now, as the schedulers themselves say
    (each router's view of the replicas' load refreshes on a period of its own: two routers may disagree)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for replica in serve.call("GET", "/admin/status").json()["replicas"]:
            if replica["index"] == 0:
                continue
            with grpc.insecure_channel(replica["address"]) as channel:
                stub = scheduler_pb2_grpc.SchedulerStub(channel)
                try:
                    running = stub.GetStats(scheduler_pb2.GetStatsRequest(), timeout=5,
                                            metadata=[(internal_token.METADATA_KEY, TOKEN)]).num_running
                except grpc.RpcError:
                    continue
            if running:
                return next(c["pid"] for c in replica["children"] if c["name"].startswith("scheduler"))
        time.sleep(0.02)
    raise AssertionError(f"no decode replica runs the request: {serve.replicas()}")


# -- the Responses API -----------------------------------------------------------------------------------

def _responses(serve: Serve, rid: str, key: str, last: str | None = None, limit: int | None = None):
    """(the open response, its events) of a streamed Responses request from the client holding `key`."""
    body = {"model": M, "input": "w5 w6 w7 w8", "max_output_tokens": LONG, "temperature": 0, "stream": True}
    head = {"Accept": "text/event-stream", "X-Request-Id": rid, "Authorization": f"Bearer {key}"}
    if last is not None:
        head["Last-Event-ID"] = last
    resp = requests.post(f"{serve.base_url}/v1/responses", json=body, headers=head, stream=True, timeout=120)
    resp.client_port = _client_port(resp)  # type: ignore[attr-defined]
    if resp.status_code != 200:
        return resp, []
    return resp, _read(resp, limit)


def _text(events_: list[tuple[str | None, dict]]) -> str:
    return "".join(e["delta"] for _, e in events_ if e["type"] == "response.output_text.delta")


def test_a_responses_stream_resumes_after_its_routers_sigkill_for_its_own_client_only(serve):
    serve.wait_ready(3)  # (the replica killed before is back)
    before = success_total(serve.base_url)
    resp, whole = _responses(serve, "r-undisturbed", "alice")
    resp.close()
    assert whole[-1][1]["type"] in ("response.completed", "response.incomplete") and _text(whole)
    resp, have = _responses(serve, "r-1", "alice", limit=30)
    headers = dict(resp.headers)
    assert sum(e["type"] == "response.output_text.delta" for _, e in have) >= 10
    _kill_router(serve, _holder(serve, resp.client_port))
    resp.close()
    last = have[-1][0]
    assert last is not None
    other, nothing = _responses(serve, "r-1", "mallory", last=last)  # another key: as if there were no such stream
    assert other.status_code == 404 and not nothing, other.text
    resp, rest = _responses(serve, "r-1", "alice", last=last)
    resp.close()
    assert resp.status_code == 200 and resp.headers["X-Request-Id"] == headers["X-Request-Id"] == "r-1"
    assert resp.headers["Content-Type"] == headers["Content-Type"] == "text/event-stream"
    got = have + rest
    assert _text(got) == _text(whole)  # token-exact: the same greedy text, nothing repeated or missing
    assert [e["sequence_number"] for _, e in got] == list(range(len(got)))
    final, undisturbed = got[-1][1]["response"], whole[-1][1]["response"]
    assert final["output"][0]["content"][0]["text"] == undisturbed["output"][0]["content"][0]["text"]
    assert final["id"] == "resp_r-1" and final["output"][0]["id"] == "msg_r-1"
    stored = requests.get(f"{serve.base_url}/v1/responses/resp_r-1", timeout=10)  # (in Redis: any router has it)
    assert stored.status_code == 200 and stored.json()["output"] == final["output"]
    # no counter went back across the router's death and restart, whichever router answers
    assert min(success_total(serve.base_url) for _ in range(6)) >= before + 1


# -- no orphans ---------------------------------------------------------------------------------------------

def _descendants(pid: int) -> set[int]:
    """Every process below `pid` now."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (FileNotFoundError, ProcessLookupError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.add(child)
            todo.append(child)
    return out


@pytest.mark.skipif(shutil.which("nginx") is None, reason="nginx is not installed (make install installs nginx-light)")
def test_a_sigkill_to_serve_under_load_through_nginx_leaves_no_process_alive(serve, model_dir, tmp_path):
    serve.wait_ready(3)
    port = free_port()
    conf = TEMPLATE.read_text().replace("{{PREFIX}}", str(tmp_path)).replace("{{LISTEN}}", f"127.0.0.1:{port}")
    (tmp_path / "nginx.conf").write_text(conf.replace("{{UPSTREAMS}}", f"server 127.0.0.1:{serve.port};"))
    nginx = subprocess.Popen(["nginx", "-p", str(tmp_path), "-c", str(tmp_path / "nginx.conf"), "-g", "daemon off;"],
                             stderr=open(tmp_path / "nginx.out", "wb"))
    try:
        batch = prompts(384, (5, 17, 9, 30))
        ref = reference_model(model_dir)
        want = [reference_tokens(ref, p, 32) for p in batch]
        with Load([f"http://127.0.0.1:{port}"], M, batch, want, 32, clients=4) as load:
            load.wait_answers(4)
            processes = _descendants(serve.proc.pid)
            names = re.findall(r"started (\S+) \(pid", serve.text())
            assert len(processes) >= 2 + 3 * 2, (processes, names)  # routers, schedulers, stages (and more)
            metrics = metrics_dirs(processes)  # (serve cannot remove them after a SIGKILL)
            serve.proc.send_signal(signal.SIGKILL)
            serve.proc.wait(10)
            deadline = time.monotonic() + 40
            while (left := [p for p in processes if alive(p)]) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert not left, f"left alive after serve's SIGKILL: {left}"
            assert metrics, "the routers wrote no metrics"
            for folder in metrics:
                shutil.rmtree(folder)
            load.stopping.set()
    finally:
        nginx.terminate()
        nginx.wait(timeout=10)
