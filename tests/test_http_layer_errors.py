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
def router(tiny_model_dir, tmp_path_factory):
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
        yield port
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


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
