"""The scheduler's health check of its stages (GrpcPipeline.probe) over real gRPC: a stage whose Describe runs past
the probe deadline while it answers steps is busy, not gone, and the pipeline stays; a stage that answers neither
is reported, and so is one that no longer listens. And the step path (scheduler.step_stream): a step the stage
does not answer fails at its deadline, and a stage that goes away fails the steps in flight, naming it, as a
Forward call would; the next step opens a new stream.

The stage here is a gRPC servicer whose Describe can be made slow: a real stage cannot be made slow at its health
check alone, which is what a loaded host does to it (CI saw a pipeline broken by a 2 s Describe under load)."""
from __future__ import annotations

import asyncio
from dataclasses import replace

import grpc
import pytest

from mesh import free_port
from scheduler.grpc_pipeline import GrpcPipeline
from scheduler.pipeline import StageFailure
from scheduler.rendezvous import ModelIdentity, Rendezvous, StageInfo
from stagemesh.core.deadlines import DEADLINES
from stagemesh.core.step import StepBatch
from stagemesh.v1 import stage_pb2, stage_pb2_grpc

MODEL = ModelIdentity("llama", 2, 64, 384, 4, 2)
PROBE_S = 0.2


class Stage(stage_pb2_grpc.StageServicer):
    def __init__(self):
        self.describe_delay_s = 0.0
        self.answer_steps = True

    async def Describe(self, request, context):
        await asyncio.sleep(self.describe_delay_s)
        return stage_pb2.StageDescription(instance_id="one")

    async def Forward(self, request, context):
        return stage_pb2.ForwardResponse()  # a step of no sequences

    async def ForwardStream(self, request_iterator, context):
        async for request in request_iterator:
            if self.answer_steps:
                yield stage_pb2.ForwardResponse(step_id=request.step.step_id)


async def _with_stage(check, forward_s: float = DEADLINES.forward_s) -> None:
    port = free_port()
    server = grpc.aio.server()
    stage = Stage()
    stage_pb2_grpc.add_StageServicer_to_server(stage, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    info = StageInfo(0, 0, 2, 1, "cpu", 100, 16, MODEL, f"127.0.0.1:{port}", "grpc", instance_id="one")
    rendezvous = Rendezvous(1, 16, MODEL)
    rendezvous.register(info)
    pipeline = GrpcPipeline(rendezvous, "127.0.0.1", 0, replace(DEADLINES, probe_s=PROBE_S, forward_s=forward_s))
    pipeline.plan = rendezvous.plan()
    try:
        await check(stage, pipeline, server)
    finally:
        await server.stop(None)


def test_a_stage_that_answers_steps_is_kept_when_its_health_check_runs_late():
    async def check(stage, pipeline, server):
        assert await pipeline.probe() is None  # quick: healthy
        stage.describe_delay_s = PROBE_S * 3
        await pipeline.forward(1, StepBatch(0), None, [])
        assert await pipeline.probe() is None  # late, but it answered a step since the last round
        failure = await pipeline.probe()  # late, and no step since: it may hang
        assert failure is not None and failure.timed_out and "DEADLINE_EXCEEDED" in str(failure)

    asyncio.run(_with_stage(check))


def test_a_stage_that_stopped_listening_is_reported_even_after_a_step():
    async def check(stage, pipeline, server):
        await pipeline.forward(1, StepBatch(0), None, [])
        await server.stop(None)
        failure = await pipeline.probe()
        assert failure is not None and failure.unreachable and not failure.timed_out

    asyncio.run(_with_stage(check))


def test_a_step_the_stage_does_not_answer_fails_at_its_deadline_and_the_next_goes_on_a_new_stream():
    async def check(stage, pipeline, server):
        await pipeline.forward(1, StepBatch(0), None, [])
        stage.answer_steps = False
        with pytest.raises(StageFailure) as err:
            await pipeline.forward(1, StepBatch(1), None, [])
        assert err.value.timed_out and "DEADLINE_EXCEEDED" in str(err.value) and "stage 0" in str(err.value)
        stage.answer_steps = True
        await pipeline.forward(2, StepBatch(0), None, [])  # (a new epoch's first step)

    asyncio.run(_with_stage(check, forward_s=0.5))


def test_a_stage_that_goes_away_fails_the_steps_in_flight_naming_it():
    async def check(stage, pipeline, server):
        await pipeline.forward(1, StepBatch(0), None, [])
        stage.answer_steps = False
        step = asyncio.ensure_future(pipeline.forward(1, StepBatch(1), None, []))
        await asyncio.sleep(0.2)
        await server.stop(None)
        with pytest.raises(StageFailure) as err:
            await asyncio.wait_for(step, 10)
        assert "stage 0" in str(err.value) and not err.value.timed_out

    asyncio.run(_with_stage(check))
