"""The services' error interceptor (stagemesh.core.grpc_errors) on a real grpc.aio server on loopback: mapped
exceptions get their code and message, others INTERNAL with a logged traceback, a handler's own abort goes
through, unary and streaming calls alike, and a stream's cleanup runs."""
from __future__ import annotations

import asyncio
import logging

import grpc
import pytest

from stagemesh.core.errors import StagemeshError
from stagemesh.core.grpc_errors import ErrorInterceptor, by_type

log = logging.getLogger("stagemesh.test_grpc_errors")


class Full(StagemeshError):
    pass


RAISES = {b"bad": StagemeshError("bad input"), b"full": Full("queue full"), b"bug": KeyError("boom")}


async def unary(request: bytes, context) -> bytes:
    if request == b"abort":
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "aborted by the handler")
    if request in RAISES:
        raise RAISES[request]
    return b"ok:" + request


async def replies(request: bytes, context):
    yield b"first"
    await unary(request, context)
    yield b"second"


async def writes(request: bytes, context) -> None:
    """A stream written with context.write (as grpc.health.v1's Watch is), not yielded."""
    await context.write(b"first")
    await unary(request, context)


async def echo_stream(requests, context):
    async for request in requests:
        yield await unary(request, context)


class Cleanup:
    def __init__(self):
        self.done = asyncio.Event()

    async def forever(self, request: bytes, context):
        try:
            yield b"first"
            await asyncio.sleep(3600)
            yield b"never"
        finally:
            self.done.set()


async def with_server(body):
    cleanup = Cleanup()
    handlers = {"Unary": grpc.unary_unary_rpc_method_handler(unary),
                "Replies": grpc.unary_stream_rpc_method_handler(replies),
                "Writes": grpc.unary_stream_rpc_method_handler(writes),
                "Echo": grpc.stream_stream_rpc_method_handler(echo_stream),
                "Forever": grpc.unary_stream_rpc_method_handler(cleanup.forever)}
    classify = by_type((Full, grpc.StatusCode.RESOURCE_EXHAUSTED), (StagemeshError, grpc.StatusCode.INVALID_ARGUMENT))
    server = grpc.aio.server(interceptors=[ErrorInterceptor(classify, log)])
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("test.Errors", handlers)])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        return await asyncio.wait_for(body(channel, cleanup), 20)
    finally:
        await channel.close()
        await server.stop(None)


def status(call) -> tuple[grpc.StatusCode, str]:
    async def run():
        try:
            return grpc.StatusCode.OK, await call
        except grpc.aio.AioRpcError as err:
            return err.code(), err.details()
    return run()


@pytest.mark.parametrize("request_, want", [
    (b"fine", (grpc.StatusCode.OK, b"ok:fine")),
    (b"bad", (grpc.StatusCode.INVALID_ARGUMENT, "bad input")),
    (b"full", (grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full")),  # the first entry that matches
    (b"abort", (grpc.StatusCode.FAILED_PRECONDITION, "aborted by the handler")),
    (b"bug", (grpc.StatusCode.INTERNAL, "KeyError: 'boom'")),
])
def test_a_unary_call_gets_its_exceptions_code(request_, want, caplog):
    async def body(channel, _):
        return await status(channel.unary_unary("/test.Errors/Unary")(request_, timeout=10))

    with caplog.at_level(logging.ERROR, logger=log.name):
        assert asyncio.run(with_server(body)) == want
    logged = [r for r in caplog.records if r.name == log.name]
    if request_ == b"bug":  # a bug is logged with its traceback, under the method's name
        assert len(logged) == 1 and logged[0].getMessage() == "/test.Errors/Unary failed"
        assert logged[0].exc_info[0] is KeyError
    else:
        assert not logged


@pytest.mark.parametrize("method", ["Replies", "Writes"])
def test_a_stream_keeps_what_it_sent_and_ends_with_the_code(method):
    async def body(channel, _):
        got = []
        call = channel.unary_stream(f"/test.Errors/{method}")(b"full", timeout=10)
        try:
            async for reply in call:
                got.append(reply)
        except grpc.aio.AioRpcError as err:
            return got, err.code(), err.details()

    assert asyncio.run(with_server(body)) == ([b"first"], grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full")


def test_a_bidirectional_stream_maps_and_passes_aborts():
    async def body(channel, _):
        results = []
        for last in (b"bad", b"abort", b"bug"):
            call = channel.stream_stream("/test.Errors/Echo")(iter([b"a", last]), timeout=10)
            got = []
            try:
                async for reply in call:
                    got.append(reply)
            except grpc.aio.AioRpcError as err:
                results.append((got, err.code(), err.details()))
        return results

    assert asyncio.run(with_server(body)) == [
        ([b"ok:a"], grpc.StatusCode.INVALID_ARGUMENT, "bad input"),
        ([b"ok:a"], grpc.StatusCode.FAILED_PRECONDITION, "aborted by the handler"),
        ([b"ok:a"], grpc.StatusCode.INTERNAL, "KeyError: 'boom'")]


def test_a_cancelled_stream_runs_its_cleanup():
    async def body(channel, cleanup: Cleanup):
        call = channel.unary_stream("/test.Errors/Forever")(b"", timeout=10)
        assert await call.read() == b"first"
        call.cancel()
        await asyncio.wait_for(cleanup.done.wait(), 5)
        return True

    assert asyncio.run(with_server(body))
