"""Exceptions to gRPC status codes, in one place per service: a server interceptor around every handler.

A service names the exceptions it maps (by_type, or its own function); what a handler raises is then
aborted with that code and message, unary or streaming alike, and anything else (a bug) with INTERNAL
and its traceback in the service's log. A handler that maps a case differently aborts it itself: an
abort made in the handler goes through untouched.
"""
from __future__ import annotations

import inspect
import logging
from collections.abc import Callable

import grpc

Classify = Callable[[Exception], "tuple[grpc.StatusCode, str] | None"]


def by_type(*table: tuple[type[Exception] | tuple[type[Exception], ...], grpc.StatusCode]) -> Classify:
    """The code of the first entry whose type the error is, with str(err) as the message; None otherwise."""

    def classify(err: Exception) -> tuple[grpc.StatusCode, str] | None:
        for kinds, code in table:
            if isinstance(err, kinds):
                return code, str(err)
        return None
    return classify


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, classify: Classify, log: logging.Logger, what: str | None = None):
        """log: where unexpected errors go, as "<what> failed" (what: the method's name unless given)."""
        self.classify, self.log, self.what = classify, log, what

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None:
            return None
        method = details.method

        async def abort(context, err: Exception) -> None:
            mapped = self.classify(err)
            if mapped is None:
                self.log.error("%s failed", self.what or method, exc_info=err)
                mapped = grpc.StatusCode.INTERNAL, f"{type(err).__name__}: {err}"
            await context.abort(*mapped)
        return _wrap(handler, abort)


def _wrap(handler: grpc.RpcMethodHandler, abort) -> grpc.RpcMethodHandler:
    """The handler with its behaviour wrapped (async behaviours only: the services' are all async)."""
    kinds = {(False, False): ("unary_unary", grpc.unary_unary_rpc_method_handler),
             (False, True): ("unary_stream", grpc.unary_stream_rpc_method_handler),
             (True, False): ("stream_unary", grpc.stream_unary_rpc_method_handler),
             (True, True): ("stream_stream", grpc.stream_stream_rpc_method_handler)}
    name, make = kinds[handler.request_streaming, handler.response_streaming]
    behaviour = getattr(handler, name)
    if inspect.isasyncgenfunction(behaviour):
        wrapped = _replies(behaviour, abort)
    elif inspect.iscoroutinefunction(behaviour):
        wrapped = _reply(behaviour, abort)
    else:
        return handler
    return make(wrapped, handler.request_deserializer, handler.response_serializer)


def _reply(behaviour, abort):
    async def call(request, context):
        try:
            return await behaviour(request, context)
        except grpc.aio.AbortError:  # the handler's own abort: its status is set
            raise
        except Exception as err:  # noqa: BLE001 - mapped to a status, a bug logged
            await abort(context, err)
    return call


def _replies(behaviour, abort):
    async def call(request, context):
        replies = behaviour(request, context)
        try:
            async for reply in replies:
                yield reply
        except grpc.aio.AbortError:
            raise
        except Exception as err:  # noqa: BLE001
            await abort(context, err)
        finally:
            await replies.aclose()  # its cleanup now, also when the call is cancelled between two replies
    return call
