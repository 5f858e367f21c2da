"""The gateway's HTTP server: aiohttp's, with the errors its HTTP parser finds before any handler runs (a
header past the size bound, a byte HTTP forbids in a header, a request line that is not HTTP) answered in
OpenAI's JSON shape and with their own status (431 for header fields too large, 414 for a request line too
long, 400 for the rest), as every other error of the router is, instead of aiohttp's text/plain 400.

aiohttp has no hook for these (aio-libs/aiohttp#3287): they are answered by its RequestHandler.handle_error,
so the gateway's connections are handled by a subclass of it (JSONErrorHandler), made by GatewayRunner's
server.
"""
from __future__ import annotations

import logging
import re

from aiohttp import web
from aiohttp.http_exceptions import BadHttpMethod, HttpProcessingError, LineTooLong

from router.errors import APIError

# a request line may be longer than a header field (a resume URL, a long query), so that the limit a
# LineTooLong reports says which of the two it was (aiohttp's parsers say it no other way)
MAX_REQUEST_LINE_BYTES = 16 * 1024
MAX_HEADER_FIELD_BYTES = 8190  # aiohttp's default
MAX_HEADERS = 128  # aiohttp's default
_QUOTED = re.compile(r"\bb'|bytearray\(|['\"]")
_HEADER_NAME = re.compile(r"b'([!#$%&*+\-.^_`|~0-9A-Za-z]+):")  # how aiohttp quotes the offending header line
log = logging.getLogger("stagemesh.router")


def describe(status: int, exc: BaseException | None) -> APIError:
    """The error a client gets for what aiohttp's parser (or a handler that raised past the middleware)
    found. Header contents are not echoed: the offending one may be a credential."""
    if isinstance(exc, LineTooLong):
        limit = exc.args[1] if len(exc.args) > 1 else None
        if limit == MAX_REQUEST_LINE_BYTES:
            return APIError(414, f"the request line is longer than {MAX_REQUEST_LINE_BYTES:,} bytes")
        return APIError(431, f"a request header field is longer than {MAX_HEADER_FIELD_BYTES:,} bytes "
                             "(name and value)")
    if isinstance(exc, HttpProcessingError):
        text = str(exc.message or "").strip()
        if text == "Too many headers received":
            return APIError(431, f"the request has more than {MAX_HEADERS} header fields")
        # aiohttp's first line, cut before what it quotes of the request (a header's value, a credential's)
        what = _QUOTED.split(text.splitlines()[0])[0].strip().rstrip(":") if text else ""
        what = what or "malformed request"
        header = _HEADER_NAME.search(text)
        if header is not None:
            return APIError(400, f"the request is not valid HTTP: {what} in the header {header[1]!r}", header[1])
        return APIError(400, f"the request is not valid HTTP: {what}")
    if status == 504:  # a handler timed out past the middleware
        return APIError(504, "the request timed out")
    return APIError(status, "internal error; the server log has the details" if status >= 500 else
                    "the request could not be served")


class JSONErrorHandler(web.RequestHandler):
    __slots__ = ()

    def handle_error(self, request, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if request.writer.output_size > 0:  # (as aiohttp's own: the connection is broken, nothing can be said)
            raise ConnectionError("the response was started already: the error cannot be sent")
        error = describe(status, exc)
        if error.status >= 500:
            log.error("error serving %s %s", request.method, request.path, exc_info=exc)
        else:  # a client's malformed request: one line, no traceback (debug for what is not HTTP at all: TLS
            # hellos and scanners on a public port, as aiohttp logs them)
            level = logging.DEBUG if isinstance(exc, BadHttpMethod) else logging.INFO
            log.log(level, "refused a malformed HTTP request from %s: %s", request.remote, error.message)
        resp = error.response()
        resp.force_close()  # the parser's state is unknown after an error: no keep-alive (as aiohttp's)
        return resp


class _JSONErrorServer(web.Server):
    def __call__(self) -> web.RequestHandler:
        return JSONErrorHandler(self, loop=self._loop, **self._kwargs)


class GatewayRunner(web.AppRunner):
    """aiohttp's AppRunner whose connections answer HTTP-level errors in JSON (JSONErrorHandler), with the
    gateway's header limits."""

    def __init__(self, app: web.Application, **kwargs):
        super().__init__(app, max_line_size=MAX_REQUEST_LINE_BYTES, max_field_size=MAX_HEADER_FIELD_BYTES,
                         max_headers=MAX_HEADERS, **kwargs)

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = _JSONErrorServer  # the app's own server, making JSONErrorHandlers: no state changes
        return server
