"""What aiohttp's HTTP parser refuses before any handler runs (a header past the size bound, a byte HTTP
forbids in a header, a request line that is not HTTP) and a body that cannot be decoded: each is answered
in OpenAI's JSON error shape with its own status, as every other error of the router, not as text/plain.
A real `stagemesh router` process (over a replica that is not there: no request here reaches one), spoken
to over raw sockets, since no HTTP client sends these."""
from __future__ import annotations

import gzip
import json
import socket
import subprocess
import sys
import threading
import time

import pytest
import requests

from mesh import free_port
from tiny_models import with_word_tokenizer

pytestmark = pytest.mark.slow  # starts a router process
KEY = "sk-test"
AUTH = b"Authorization: Bearer " + KEY.encode() + b"\r\n"
BODY = b'{"model": "m", "prompt": "w5", "max_tokens": 2}'


@pytest.fixture(scope="module")
def router_process(tiny_model_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("http-errors")
    model = with_word_tokenizer(tiny_model_dir("llama"), logs / "tok")
    port = free_port()
    argv = [sys.executable, "-m", "stagemesh", "router", str(model), "--port", str(port), "--replica",
            f"127.0.0.1:{free_port()}", "--served-model-name", "m", "--api-key", KEY]
    with open(logs / "router.log", "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, (logs / "router.log").read_text()
            try:
                if requests.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                pass
            assert time.monotonic() < deadline, "the router did not start"
            time.sleep(0.1)
        yield port, proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def router(router_process):
    return router_process[0]


def exchange(port: int, raw: bytes) -> tuple[int, dict, bytes]:
    """Sends `raw` as it is; (status, headers, body) of the answer, read to the connection's end."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(raw)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    return int(lines[0].split()[1]), headers, body


def get(extra: bytes, target: bytes = b"/v1/models") -> bytes:
    return b"GET " + target + b" HTTP/1.1\r\nHost: 127.0.0.1\r\n" + AUTH + extra + b"\r\n"


CASES = [  # (what, raw request, status, words in the message, param)
    ("a 60 KB header", get(b"X-Big: " + b"a" * 60_000 + b"\r\n"), 431, "header field is longer than 8,190 bytes",
     None),
    ("a 10 KB X-Request-Id", get(b"X-Request-Id: " + b"r" * 10_240 + b"\r\n"), 431,
     "header field is longer than 8,190 bytes", None),
    ("200 headers", get(b"".join(b"X-H%d: v\r\n" % i for i in range(200))), 431, "more than 128 header fields",
     None),
    ("a control byte in Authorization", b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer a\x01b\r\n\r\n",
     400, "Invalid header value char in the header 'Authorization'", "Authorization"),
    ("a garbage request line", b"\x16\x03\x01\x02\x00garbage\r\n\r\n", 400, "not valid HTTP", None),
    ("a request line of another protocol", b"HELLO WORLD\r\n\r\n", 400, "not valid HTTP", None),
    ("a 20 KB request line", get(b"", b"/v1/models?" + b"q" * 20_000), 414, "request line is longer than 16,384",
     None),
    ("a gzip body that is not gzip", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + AUTH +
     b"Content-Type: application/json\r\nContent-Encoding: gzip\r\nContent-Length: %d\r\n\r\n" % len(BODY) + BODY,
     400, "the request body could not be read: Can not decode content-encoding: gzip", None),
]


@pytest.mark.parametrize("what, raw, status, words, param", CASES, ids=[c[0] for c in CASES])
def test_http_level_errors_are_openai_json_with_their_status(router, what, raw, status, words, param):
    code, headers, body = exchange(router, raw)
    assert code == status, (what, code, body[:300])
    assert headers["content-type"].startswith("application/json"), (what, headers, body[:300])
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status, error
    assert words in error["message"] and error["param"] == param, error
    assert KEY not in error["message"] and "a\x01b" not in error["message"]  # a header's value is not echoed
    assert requests.get(f"http://127.0.0.1:{router}/health", timeout=5).status_code == 200


def test_a_well_formed_request_beside_them_is_answered(router):
    raw = b"POST /tokenize HTTP/1.1\r\nHost: x\r\nConnection: close\r\n" + AUTH + \
        b"Content-Type: application/json\r\nContent-Encoding: gzip\r\nContent-Length: %d\r\n\r\n"
    body = gzip.compress(b'{"prompt": "w5 w6"}')
    code, _, answer = exchange(router, raw % len(body) + body)
    assert code == 200 and json.loads(answer)["tokens"][-2:] == [5, 6], answer


def _memory_kib(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(next(line.split()[1] for line in f if line.startswith(field + ":")))


def _send_chunked(port: int, body: bytes, headers: bytes) -> bytes:
    """POST `body` to /v1/completions with Transfer-Encoding: chunked (1 MiB chunks, no Content-Length) while
    reading the answer; the answer's bytes (the router may answer, and close, before the body is all sent)."""
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + AUTH + headers +
            b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        def send() -> None:
            try:
                s.sendall(head)
                for at in range(0, len(body), 1 << 20):
                    part = body[at:at + (1 << 20)]
                    s.sendall(b"%x\r\n" % len(part) + part + b"\r\n")
                s.sendall(b"0\r\n\r\n")
            except OSError:  # the router closed the connection after its answer
                pass

        sender = threading.Thread(target=send, daemon=True)
        sender.start()
        data = b""
        while b"}}" not in data and (more := s.recv(65536)):
            data += more
        sender.join(timeout=60)
    return data


@pytest.mark.parametrize("encoding", ["identity", "gzip"])
def test_a_chunked_body_past_the_bound_is_a_413_without_the_router_holding_it(router_process, encoding):
    """Transfer-Encoding: chunked, no Content-Length: 64 MiB of body, or a gzip body of 256 KB that inflates to
    256 MiB. The router answers 413 once what arrived (inflated) passes its 32 MiB bound, holding no more than
    that (its peak RSS grows by under 48 MiB; aiohttp's own read() inflated the gzip body whole, 408 MiB), and
    goes on serving."""
    port, proc = router_process
    with open(f"/proc/{proc.pid}/clear_refs", "w") as f:
        f.write("5")  # (the peak RSS starts over from the RSS now)
    before = _memory_kib(proc.pid, "VmRSS")
    if encoding == "gzip":
        data = _send_chunked(port, gzip.compress(b" " * (256 << 20)), b"Content-Encoding: gzip\r\n")
    else:
        data = _send_chunked(port, b" " * (64 << 20), b"")
    status_line, _, rest = data.partition(b"\r\n")
    assert status_line.split()[1] == b"413", data[:300]
    error = json.loads(rest.partition(b"\r\n\r\n")[2])["error"]
    assert error["code"] == 413 and "larger than 33,554,432 bytes" in error["message"], error
    grown_mib = (_memory_kib(proc.pid, "VmHWM") - before) / 1024
    print(f"{encoding}: the router's peak RSS grew by {grown_mib:.0f} MiB")
    assert grown_mib < 48, grown_mib
    assert requests.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200


def test_detokenize_and_tokenize_bound_their_token_counts(router):
    """/detokenize takes no more token ids than the model's positions (counted before each is checked);
    /tokenize no more text than they can hold."""
    base, auth = f"http://127.0.0.1:{router}", {"Authorization": f"Bearer {KEY}"}
    resp = requests.post(f"{base}/detokenize", json={"model": "m", "tokens": [5] * 3_000_000}, headers=auth,
                         timeout=60)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "tokens", resp.text[:300]
    message = resp.json()["error"]["message"]
    assert "'tokens' has 3,000,000 token ids: more than any sequence this model takes" in message
    resp = requests.post(f"{base}/tokenize", json={"model": "m", "prompt": "w5 " * 3_000_000}, headers=auth,
                         timeout=60)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "prompt", resp.text[:300]
    ok = requests.post(f"{base}/detokenize", json={"model": "m", "tokens": [5, 6]}, headers=auth, timeout=60)
    assert ok.status_code == 200 and ok.json()["prompt"] == "w5 w6", ok.text

