"""A request body read and parsed with bounds: size (the app's client_max_size, whatever the transfer or content
encoding: a Content-Length past it is refused before any byte is read, a chunked or compressed body as soon as
what arrived passes it, so no more than the bound is ever held), time to arrive, JSON nesting depth (checked
before the parser recurses), and text that is valid Unicode.

Large bodies are parsed on a worker thread, so one request cannot stall the event loop.
"""
from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import numpy as np
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

from router.errors import APIError, bad_request

MAX_DEPTH = 64
BODY_TIMEOUT_S = 30.0
INLINE_BYTES = 64 * 1024  # smaller bodies are parsed on the event loop (a thread hop costs more)
_STRINGS = re.compile(rb'"[^"]*"')  # once escapes are gone: linear, however the quotes fall
_ESCAPED_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]")
_BRACKETS = bytes(range(256)).translate(None, b"[]{}")  # everything but brackets, to delete


async def read_json(request) -> Any:
    try:
        body = await asyncio.wait_for(read_body(request, request.client_max_size), BODY_TIMEOUT_S)
    except asyncio.TimeoutError:
        raise APIError(408, f"the request body did not arrive within {BODY_TIMEOUT_S:.0f}s") from None
    except (RequestPayloadError, HttpProcessingError) as err:  # a body its Content-Encoding cannot decode, ...
        cause = err.__cause__ if isinstance(err.__cause__, HttpProcessingError) else err
        what = str(getattr(cause, "message", "") or cause).strip().splitlines()
        raise bad_request(f"the request body could not be read: {what[0] if what else type(err).__name__}") \
            from None
    if len(body) <= INLINE_BYTES:
        return parse(body)
    return await asyncio.to_thread(parse, body)


async def read_body(request, limit: int) -> bytes:
    """The body, decoded as its Content-Encoding says, or a 413 once it is past `limit` bytes. (aiohttp's own
    read() first raises the size it inflates at a time to the bound, so that a gzip body of 256 KB was inflated
    whole, 256 MiB, before its size was looked at.)"""
    if request.content_length is not None and request.content_length > limit:
        raise _too_large(limit)
    body = bytearray()
    while chunk := await request.content.readany():
        body += chunk
        if len(body) > limit:
            raise _too_large(limit)
    return bytes(body)


def _too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is larger than {limit:,} bytes (the server's bound)")


def parse(body: bytes) -> Any:
    if json_depth(body) > MAX_DEPTH:
        raise bad_request(f"the request body nests JSON deeper than {MAX_DEPTH} levels")
    try:
        value = json.loads(body)
    except (ValueError, UnicodeDecodeError) as err:  # JSONDecodeError, and integers past 4,300 digits
        raise bad_request(f"the request body is not valid JSON: {err}") from None
    except RecursionError:  # not reached after json_depth; kept as the last line of defence
        raise bad_request(f"the request body nests JSON deeper than {MAX_DEPTH} levels") from None
    if _ESCAPED_SURROGATE.search(body):
        _check_text(value, "")
    return value


def json_depth(body: bytes) -> int:
    """The deepest bracket nesting of a JSON text, at C speed and linear in its length: escaped backslashes
    and quotes removed (left to right, as JSON reads them), then strings, then all but brackets, summed."""
    unescaped = body.replace(b"\\\\", b"").replace(b'\\"', b"")
    brackets = _STRINGS.sub(b"", unescaped).translate(None, _BRACKETS)
    if not brackets:
        return 0
    steps = np.frombuffer(brackets, dtype=np.uint8)
    depth = np.cumsum(np.where((steps == ord("[")) | (steps == ord("{")), 1, -1), dtype=np.int64)
    return int(depth.max())


def _check_text(value: Any, where: str) -> None:
    """Lone UTF-16 surrogates (a "\\ud800" escape) are not text: no tokenizer can take them."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise bad_request(f"'{where or 'body'}' holds a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff "
                              "escape), which is not valid Unicode", where or None) from None
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_text(key, where)
            _check_text(item, f"{where}.{key}" if where else str(key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _check_text(item, f"{where}[{i}]")
