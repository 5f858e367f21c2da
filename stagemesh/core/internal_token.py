"""The shared secret of a mesh's internal RPCs (scheduler and stages): who may call them.

Every internal service checks it on every call but grpc.health.v1 and reflection (probes
stay open); every internal client sends it, through the channels of stagemesh.core.service_options.
It comes from --internal-token-file, --internal-token (visible in `ps`: prefer the file) or
the STAGEMESH_INTERNAL_TOKEN variable (what `stagemesh serve` gives its children). Without
one the services accept every caller and say so once at start-up; mTLS (--tls-*) stays
available beside it.
"""
from __future__ import annotations

import argparse
import hmac
import logging
import os
import secrets
from pathlib import Path

import grpc

from stagemesh.core.errors import StagemeshError

ENV = "STAGEMESH_INTERNAL_TOKEN"
METADATA_KEY = "stagemesh-internal-token"
OPEN_SERVICES = ("/grpc.health.v1.Health/", "/grpc.reflection.")
log = logging.getLogger("stagemesh")

_token: str | None = None


def configure(args: argparse.Namespace) -> str | None:
    """Read this process's token from its flags or the environment; returns it (None: none)."""
    global _token
    token, file = getattr(args, "internal_token", None), getattr(args, "internal_token_file", None)
    if token and file:
        raise StagemeshError("--internal-token and --internal-token-file: give one")
    if file:
        try:
            token = Path(file).read_text().strip()
        except OSError as err:
            raise StagemeshError(f"--internal-token-file {file}: {err.strerror}") from None
    token = token or os.environ.get(ENV) or None
    if token is not None and len(token) < 16:
        raise StagemeshError("the internal token must have at least 16 characters")
    _token = token
    return token


def token() -> str | None:
    return _token


def new_token() -> str:
    return secrets.token_urlsafe(32)


def warn_if_open(service: str) -> None:
    if _token is None:
        log.warning("%s: internal RPCs are not authenticated (no --internal-token-file or $%s): keep the "
                    "services on a private network", service, ENV)


def _authorized(metadata) -> bool:
    given = next((value for key, value in (metadata or ()) if key == METADATA_KEY), None)
    return isinstance(given, str) and _token is not None and hmac.compare_digest(given.encode(), _token.encode())


class ServerInterceptor(grpc.aio.ServerInterceptor):
    """Refuses (UNAUTHENTICATED) every call without the token, before its handler runs."""

    async def intercept_service(self, continuation, details):
        if _token is None or details.method.startswith(OPEN_SERVICES) or _authorized(details.invocation_metadata):
            return await continuation(details)
        handler = await continuation(details)
        return None if handler is None else _denying(handler, details.method)


def _denying(handler, method: str):
    message = f"{method} needs the mesh's internal token (metadata '{METADATA_KEY}')"

    async def deny(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def deny_stream(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover - abort raises

    kinds = {(False, False): grpc.unary_unary_rpc_method_handler, (False, True): grpc.unary_stream_rpc_method_handler,
             (True, False): grpc.stream_unary_rpc_method_handler, (True, True): grpc.stream_stream_rpc_method_handler}
    streams = (handler.request_streaming, handler.response_streaming)
    return kinds[streams](deny_stream if streams[1] else deny, handler.request_deserializer,
                          handler.response_serializer)


def _with_token(metadata, value: str):
    return (*(metadata or ()), (METADATA_KEY, value))


class _AioDetails(grpc.aio.ClientCallDetails):
    pass


class _AioInterceptor:
    def __init__(self, value: str):
        self.value = value

    def _details(self, d):
        return _AioDetails(d.method, d.timeout, _with_token(d.metadata, self.value), d.credentials, d.wait_for_ready)


class _AioUnaryUnary(_AioInterceptor, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(self._details(details), request)


class _AioUnaryStream(_AioInterceptor, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(self._details(details), request)


class _AioStreamUnary(_AioInterceptor, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, details, request_iterator):
        return await continuation(self._details(details), request_iterator)


class _AioStreamStream(_AioInterceptor, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, details, request_iterator):
        return await continuation(self._details(details), request_iterator)


def aio_client_interceptors(value: str | None = None) -> list:
    """Interceptors that add the token (this process's unless one is given) to every call of a grpc.aio
    channel: one per kind of call, since a channel files each interceptor under its first kind only."""
    value = value or _token
    if value is None:
        raise ValueError("no internal token to send (set one with --internal-token or $STAGEMESH_INTERNAL_TOKEN)")
    return [kind(value) for kind in (_AioUnaryUnary, _AioUnaryStream, _AioStreamUnary, _AioStreamStream)]


class _SyncDetails(grpc.ClientCallDetails):
    def __init__(self, d, value: str):
        self.method, self.timeout, self.credentials = d.method, d.timeout, d.credentials
        self.metadata, self.wait_for_ready = _with_token(d.metadata, value), getattr(d, "wait_for_ready", None)
        self.compression = getattr(d, "compression", None)


class SyncClientInterceptor(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                            grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds the token (this process's unless one is given) to every call of a blocking channel."""

    def __init__(self, value: str | None = None):
        value = value or _token
        if value is None:  # (as aio_client_interceptors refuses it: no call could carry it)
            raise ValueError("no internal token to send (set one with --internal-token or $STAGEMESH_INTERNAL_TOKEN)")
        self.value = value

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(_SyncDetails(details, self.value), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(_SyncDetails(details, self.value), request)

    def intercept_stream_unary(self, continuation, details, request_iterator):
        return continuation(_SyncDetails(details, self.value), request_iterator)

    def intercept_stream_stream(self, continuation, details, request_iterator):
        return continuation(_SyncDetails(details, self.value), request_iterator)
