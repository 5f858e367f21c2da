"""A server that streams as llama-cpp-python's does, for `stagemesh bench`'s token counting: text chunks, no
usage and no token ids whatever the request asks, and a 400 for an X-Request-Id that is not a UUID (its
starlette_context middleware). Each chunk carries two words of a word-level vocabulary ("w7 w7 "), so that
counting chunks gives half the tokens. `--tokenize extras` serves POST /extras/tokenize (a BOS, id 1, before
the text's ids, as llama.cpp adds one); `--tokenize none` serves no tokenize endpoint.

    python tests/text_stream_server.py PORT [--tokenize extras|none]
"""
from __future__ import annotations

import argparse
import json
import uuid

from aiohttp import web


def _ids(text: str) -> list[int]:
    return [int(w[1:]) if w[1:].isdigit() else 0 for w in text.split()]  # 0: <unk>


async def completions(request: web.Request) -> web.StreamResponse:
    given = request.headers.get("X-Request-Id")
    if given is not None:
        try:
            uuid.UUID(given)
        except ValueError:
            return web.Response(status=400)  # llama-cpp-python 0.3.36 answers 400, no body
    body = await request.json()
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    left = int(body["max_tokens"])
    while left > 0:
        n = min(2, left)
        left -= n
        chunk = {"id": "cmpl-x", "object": "text_completion", "model": "fake",
                 "choices": [{"index": 0, "text": "w7 " * n, "finish_reason": None if left else "length"}]}
        await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
    await resp.write(b"data: [DONE]\n\n")
    return resp


async def models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [{"id": "fake", "object": "model"}]})


async def extras_tokenize(request: web.Request) -> web.Response:
    return web.json_response({"tokens": [1, *_ids((await request.json())["input"])]})


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("port", type=int)
    p.add_argument("--tokenize", choices=("extras", "none"), default="extras")
    args = p.parse_args()
    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    if args.tokenize == "extras":
        app.router.add_post("/extras/tokenize", extras_tokenize)
    web.run_app(app, host="127.0.0.1", port=args.port, print=None)


if __name__ == "__main__":
    main()
