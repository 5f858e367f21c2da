"""The steps to one stage over one long-lived Stage.ForwardStream: a message per step each way.

A Forward call per step costs both ends a call's set-up (its task, its metadata, its deadline, the
interceptors' layers): a few hundred microseconds of CPU each, per step, at any batch size. On a stream a
step is one message out and one back (bench_control_plane.py measures the difference). Each step keeps its own
deadline (--forward deadline, as the call's), and every failure is the one the call would have raised: the
stream's status names the stage (StageFailure), a step past its deadline fails as timed out. A stream that
ended fails the steps it still carried; the next step opens a new one.
"""
from __future__ import annotations

import asyncio
import logging
from collections import deque

import grpc

from scheduler.pipeline import StageFailure
from scheduler.rendezvous import StageInfo
from stagemesh.v1 import stage_pb2, stage_pb2_grpc

log = logging.getLogger("stagemesh.scheduler")


class StepStream:
    def __init__(self, stage: StageInfo, stub: stage_pb2_grpc.StageStub, deadline_s: float):
        self.stage, self.deadline_s = stage, deadline_s
        self.closed = False
        self._outbox: deque[stage_pb2.ForwardRequest] = deque()
        self._ready = asyncio.Event()
        self._pending: dict[int, tuple[asyncio.Future, float]] = {}  # step id -> its reply, its deadline (loop time)
        self._timer: asyncio.TimerHandle | None = None  # at the oldest pending step's deadline (_check_deadlines)
        self._call = stub.ForwardStream(self._requests())  # (no deadline: each step has its own)
        self._reader = asyncio.create_task(self._read())

    def send(self, request: stage_pb2.ForwardRequest) -> asyncio.Future:
        """The step goes out on the stream; the future gives its ForwardResponse or raises StageFailure."""
        loop = asyncio.get_running_loop()
        step_id = request.step.step_id
        future = loop.create_future()
        if self.closed:
            future.set_exception(StageFailure(self.stage, "its step stream ended", unreachable=True))
            return future
        self._pending[step_id] = (future, loop.time() + self.deadline_s)
        if self._timer is None:
            self._timer = loop.call_later(self.deadline_s, self._check_deadlines)
        self._outbox.append(request)
        self._ready.set()
        return future

    def close(self) -> None:
        """End the stream: the steps it carries fail (the channel is dropped, the scheduler stops)."""
        if not self.closed:
            self._fail(StageFailure(self.stage, "the call was cancelled"))
            self._call.cancel()

    async def _requests(self):
        while True:
            await self._ready.wait()
            self._ready.clear()
            while self._outbox:
                yield self._outbox.popleft()

    async def _read(self) -> None:
        try:
            async for reply in self._call:
                entry = self._pending.pop(reply.step_id, None)
                if entry is None:
                    continue  # a step that timed out meanwhile
                future = entry[0]
                if not future.done():
                    future.set_result(reply)
            failure = StageFailure(self.stage, "it ended its step stream", unreachable=True)
        except grpc.aio.AioRpcError as err:  # as a Forward call's failure reads (grpc_pipeline._answer)
            failure = StageFailure(self.stage, f"{err.code().name}: {err.details()}",
                                   unreachable=err.code() == grpc.StatusCode.UNAVAILABLE,
                                   timed_out=err.code() == grpc.StatusCode.DEADLINE_EXCEEDED)
        except asyncio.CancelledError:  # close(), or the channel closed under it
            failure = StageFailure(self.stage, "the call was cancelled")
        except Exception as err:  # a bug here must not leave steps waiting until their deadline
            log.exception("reading the step stream of %s failed", self.stage.name)
            failure = StageFailure(self.stage, f"{type(err).__name__}: {err}")
        self._fail(failure)

    def _check_deadlines(self) -> None:
        """One timer for the stream rather than one a step: at the oldest pending step's deadline (steps are
        answered in order, so that is the first to pass its own), fail it, or wait for the next oldest's."""
        self._timer = None
        if not self._pending:
            return
        step_id, (_, deadline) = next(iter(self._pending.items()))
        loop = asyncio.get_running_loop()
        if loop.time() < deadline:
            self._timer = loop.call_at(deadline, self._check_deadlines)
            return
        self._expire(step_id)

    def _expire(self, step_id: int) -> None:
        """A step past its deadline: it fails as a Forward call would (the epoch ends), and the stream with it."""
        entry = self._pending.pop(step_id, None)
        if entry is not None and not entry[0].done():
            entry[0].set_exception(StageFailure(self.stage, "DEADLINE_EXCEEDED: Deadline Exceeded", timed_out=True))
        self._fail(StageFailure(self.stage, f"its step stream was ended: step {step_id} passed its deadline",
                                timed_out=True))
        self._call.cancel()

    def _fail(self, failure: StageFailure) -> None:
        self.closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        pending, self._pending = self._pending, {}
        for future, _ in pending.values():
            if not future.done():
                future.set_exception(failure)
