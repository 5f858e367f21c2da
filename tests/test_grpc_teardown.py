"""A stopping service's log stays clean of grpc.aio's known teardown noise (grpc/grpc#34139), and only of that:
stagemesh.core.service_options.quiet_grpc_teardown on a real event loop."""
from __future__ import annotations

import asyncio
import errno
import logging

from stagemesh.core.service_options import quiet_grpc_teardown


def _raise_from(filename: str, err: Exception) -> Exception:
    """err raised from code whose frame names `filename` (as grpc's Cython poller's frames do)."""
    code = compile("raise err", filename, "exec")
    try:
        exec(code, {"err": err})
    except Exception as raised:  # noqa: BLE001
        return raised
    raise AssertionError("not raised")


def test_the_pollers_ebadf_at_teardown_is_not_logged_as_an_error_and_other_errors_are(caplog):
    loop = asyncio.new_event_loop()
    try:
        quiet_grpc_teardown(loop)
        quiet_grpc_teardown(loop)  # (a second server in the same loop: one handler)
        noise = _raise_from("src/python/grpcio/grpc/_cython/_cygrpc/aio/completion_queue.pyx.pxi",
                            OSError(errno.EBADF, "Bad file descriptor"))
        other_fd = _raise_from("mine.py", OSError(errno.EBADF, "Bad file descriptor"))
        other = _raise_from("src/python/grpcio/grpc/_cython/_cygrpc/aio/completion_queue.pyx.pxi",
                            OSError(errno.EIO, "I/O error"))
        with caplog.at_level(logging.DEBUG):
            for err in (noise, other_fd, other):
                loop.call_exception_handler({"message": "Exception in callback None()", "exception": err})
    finally:
        loop.close()
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 2 and all("Exception in callback" in r.getMessage() for r in errors)
    assert any("grpc/grpc#34139" in r.getMessage() and r.levelno == logging.DEBUG for r in caplog.records)
