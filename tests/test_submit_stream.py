"""Many requests over one Scheduler.SubmitStream, driven by the router's end of it, against a real replica."""
from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from mesh import Mesh, internal_aio_channel
from parity import prompts
from router.submit_stream import RequestFailed, SubmitStream
from stagemesh.core.engine_request import EngineRequest
from stagemesh.core.sampling_params import SamplingParams
from stagemesh.v1 import scheduler_pb2, scheduler_pb2_grpc

pytestmark = pytest.mark.slow
LONG = SamplingParams(max_tokens=400, ignore_eos=True)


@pytest.fixture(scope="module")
def mesh(tiny_model_dir, tmp_path_factory):
    with Mesh(tiny_model_dir("llama"), [2, 2], log_dir=tmp_path_factory.mktemp("submit-stream")) as m:
        yield m


def over_one_stream(address: str, body):
    """Run `body(stream, stub)` with a SubmitStream open to `address`."""
    async def run():
        async with internal_aio_channel(address) as channel:
            stub = scheduler_pb2_grpc.SchedulerStub(channel)
            stream = SubmitStream(stub, address)
            try:
                return await body(stream, stub)
            finally:
                stream.close()

    return asyncio.run(run())


async def read(requests, limit: int | None = None):
    """(token ids, finish reason, first reply's num_prompt_tokens), stopping after `limit` tokens if given."""
    tokens, reason, num_prompt = [], None, None
    async for reply in requests:
        num_prompt = reply.num_prompt_tokens if num_prompt is None else num_prompt
        tokens.extend(reply.token_ids)
        reason = reply.finish_reason or reason
        if limit is not None and len(tokens) >= limit:
            break
    return tokens, reason, num_prompt


async def wait_stats(stub, want, timeout: float = 15):
    deadline = time.monotonic() + timeout
    while True:
        stats = await stub.GetStats(scheduler_pb2.GetStatsRequest(), timeout=5)
        if want(stats) or time.monotonic() > deadline:
            return stats
        await asyncio.sleep(0.05)


def test_interleaved_requests_get_exactly_their_own_tokens(mesh):
    batch = prompts(384, (5, 40, 17, 3, 33, 9, 24, 12))
    samplings = [SamplingParams(max_tokens=4 + 3 * i, ignore_eos=True) for i in range(len(batch))]
    want = [mesh.submit(f"ref{i}", p, s) for i, (p, s) in enumerate(zip(batch, samplings))]

    async def body(stream, stub):
        async def one(i):
            await asyncio.sleep(0.01 * i)  # each joins while the earlier ones are decoding
            return await read(stream.submit(EngineRequest(f"mux{i}", batch[i], samplings[i])))

        return await asyncio.gather(*(one(i) for i in range(len(batch))))

    got = over_one_stream(mesh.address, body)
    assert [(tokens, reason) for tokens, reason, _ in got] == [(list(t), r) for t, r in want]
    assert [num_prompt for _, _, num_prompt in got] == [len(p) for p in batch]


def test_a_steps_outputs_for_every_sequence_come_in_one_message(mesh):
    """The scheduler writes what a step produced for all of a stream's requests as one message (never one per
    token per request): counted, not timed."""
    n, tokens = 8, 24
    before = mesh.stub.GetStats(scheduler_pb2.GetStatsRequest(), timeout=5)
    got = mesh.submit_stream([(f"count{i}", [5 + i, 6, 7], SamplingParams(max_tokens=tokens, ignore_eos=True))
                              for i in range(n)])
    steps = mesh.stub.GetStats(scheduler_pb2.GetStatsRequest(), timeout=5).num_steps - before.num_steps
    assert all(len(t) == tokens and reason == "length" for t, reason in got.values())
    # at most one message a step (a reader that falls behind gets several steps' in one); the two micro-batches
    # of the pipeline share the 8 sequences, so a message carries about 4 of them (one per token per request
    # would be n * tokens)
    assert mesh.stream_messages <= steps
    assert mesh.stream_messages <= n * tokens / 2


def test_abort_over_the_stream_frees_the_request_and_the_others_go_on(mesh):
    async def body(stream, stub):
        doomed = stream.submit(EngineRequest("doomed", [5, 6, 7], LONG))
        other = stream.submit(EngineRequest("other", [8, 9], LONG))
        await read(doomed, limit=1)
        await read(other, limit=1)
        doomed.close()  # an abort action on the shared stream
        stats = await wait_stats(stub, lambda s: s.num_running == 1)
        more, _, _ = await read(other, limit=5)
        other.close()
        return stats, more, await wait_stats(stub, lambda s: s.num_running == 0)

    during, more, after = over_one_stream(mesh.address, body)
    assert during.num_running == 1 and len(more) >= 5
    assert after.num_running == 0 and after.num_waiting == 0


def test_closing_the_stream_aborts_its_requests(mesh):
    async def body(stream, stub):
        requests = [stream.submit(EngineRequest(f"closed{i}", [5 + i, 6, 7], LONG)) for i in range(3)]
        for r in requests:
            await read(r, limit=1)
        running = (await stub.GetStats(scheduler_pb2.GetStatsRequest(), timeout=5)).num_running
        stream.close()
        return running, await wait_stats(stub, lambda s: s.num_running == 0 and s.num_waiting == 0)

    running, after = over_one_stream(mesh.address, body)
    assert running == 3
    assert after.num_running == 0 and after.num_waiting == 0 and after.kv_cache_usage == 0
    tokens, reason = mesh.submit("after-close", [5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(tokens) == 3 and reason == "length"


def test_errors_belong_to_their_request_only(tiny_model_dir, tmp_path):
    # one waiting slot, one running sequence, prefill in chunks of 16: the second submit finds the queue full
    args = ("--max-waiting-requests", "1", "--max-num-seqs", "1", "--max-num-batched-tokens", "16")
    with Mesh(tiny_model_dir("llama"), [4], scheduler_args=args, log_dir=tmp_path) as mesh:
        short = SamplingParams(max_tokens=6, ignore_eos=True)
        want, _ = mesh.submit("ref", [5, 6, 7], short)

        async def body(stream, stub):
            ok = stream.submit(EngineRequest("ok", [5, 6, 7], short))
            full = stream.submit(EngineRequest("full", [8, 9], short))
            bad = stream.submit(EngineRequest("bad", [5, 6, 7], SamplingParams(max_tokens=1_000_000)))
            prio = stream.submit(EngineRequest("prio", [5, 6, 7], short, priority=3))  # this replica runs fcfs
            outcomes = []
            for r in (full, bad, prio):
                with pytest.raises(RequestFailed) as info:
                    await read(r)
                outcomes.append((info.value.code, info.value.details))
            return outcomes, await read(ok), await read(stream.submit(EngineRequest("later", [5, 6, 7], short)))

        (full, bad, prio), ok, later = over_one_stream(mesh.address, body)
    assert full[0] == grpc.StatusCode.RESOURCE_EXHAUSTED and "waiting queue is full" in full[1]
    assert bad[0] == grpc.StatusCode.INVALID_ARGUMENT and "maximum context length" in bad[1]
    assert prio == (grpc.StatusCode.INVALID_ARGUMENT,
                    "Got priority 3 but Priority scheduling is not enabled "
                    "(this replica runs --scheduling-policy fcfs)")
    assert ok[:2] == (want, "length")
    assert later[:2] == (want, "length")


class BreakingScheduler(scheduler_pb2_grpc.SchedulerServicer):
    """Answers the first submit of each stream with one token, then fails the stream."""

    def __init__(self):
        self.streams = 0

    async def SubmitStream(self, request_iterator, context):
        self.streams += 1
        request = await anext(aiter(request_iterator))
        reply = scheduler_pb2.SubmitStreamResponse()
        for submit in request.submits:
            reply.updates.add(request_id=submit.request.request_id).output.token_ids.append(1)
        yield reply
        await context.abort(grpc.StatusCode.INTERNAL, "the scheduler fell over")


def test_a_broken_stream_fails_its_requests_naming_the_replica_and_is_reopened():
    async def run():
        server = grpc.aio.server()
        servicer = BreakingScheduler()
        scheduler_pb2_grpc.add_SchedulerServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        address = f"127.0.0.1:{port}"
        failures = []
        try:
            async with grpc.aio.insecure_channel(address) as channel:
                stub = scheduler_pb2_grpc.SchedulerStub(channel)
                stream = SubmitStream(stub, address)
                requests = [stream.submit(EngineRequest(f"r{i}", [5, 6], LONG)) for i in range(2)]
                for r in requests:
                    with pytest.raises(RequestFailed) as info:
                        await read(r)
                    failures.append(info.value)
                assert stream.closed
                again = SubmitStream(stub, address)
                with pytest.raises(RequestFailed):
                    await read(again.submit(EngineRequest("r2", [5, 6], LONG)))
        finally:
            await server.stop(None)
        return failures, servicer.streams

    failures, streams = asyncio.run(run())
    assert streams == 2
    for err in failures:
        assert err.code == grpc.StatusCode.UNAVAILABLE
        assert "the stream to replica 127.0.0.1:" in err.details and "the scheduler fell over" in err.details
