"""The router's part of the kv_load_failure_policy (issue 44), over in-process fake prefill and decode replicas (the
real processes: tests/test_disaggregated.py). A decode replica that cannot load a prompt's KV (its policy fail,
FAILED_PRECONDITION) has the prompt prefilled again, on another prefill replica when there is one, once: the
client sees its tokens without gap or repeat, or after a second failure an error; the KV no decode replica will
load is released. A prefill replica that stops passing health checks before it answers is left for another."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from fake_replicas import FakeReplica, FakeStream
from router.balancing import LeastLoad
from router.errors import APIError
from router.dispatch import Generation, dispatch
from router.replica_set import ReplicaSet
from router.submit_stream import ReplicaOutput, RequestFailed
from stagemesh.core.engine_request import EngineRequest, KVSourceInfo
from stagemesh.core.sampling_params import SamplingParams

VOCAB = 1000
PROMPT = [5, 6, 7]


def kv_params(address: str, request_id: str) -> KVSourceInfo:
    return KVSourceInfo(address, request_id, 1, (0,), 16, len(PROMPT), ())


class Prefill(FakeReplica):
    """Computes the prompt: its first token, then "prefilled" with where its KV is held; stall: never answers."""

    def __init__(self, address: str):
        super().__init__("m", 512, VOCAB, address=address)
        self.kv_role, self.stall, self.released = "prefill", False, []

    def submit(self, request: EngineRequest):
        request_id, prompt, sampling = request.request_id, list(request.prompt_token_ids), request.sampling
        assert request.prefill_only and not request.generated_token_ids and not request.kv_source
        self.submitted.append((request_id, prompt, sampling))

        async def outputs():
            if self.stall:
                await asyncio.sleep(3600)
            yield ReplicaOutput([(prompt[-1] + 1) % VOCAB], finish_reason="prefilled",
                                kv_transfer=kv_params(self.address, request_id), num_prompt_tokens=len(prompt))
        return FakeStream(outputs())

    async def release_kv(self, request_id: str) -> bool:
        self.released.append(request_id)
        return True


class Decode(FakeReplica):
    """Goes on from the first token with the KV it is given, unless that KV is in `cannot_load` (FAILED_PRECONDITION,
    as a decode replica under --kv-load-failure-policy fail)."""

    def __init__(self):
        super().__init__("m", 512, VOCAB, address="decode:0")
        self.kv_role, self.cannot_load, self.kv = "decode", set(), []

    def submit(self, request: EngineRequest):
        prompt, sampling, generated = list(request.prompt_token_ids), request.sampling, request.generated_token_ids
        kv = request.kv_source
        source = (kv.scheduler_address, kv.request_id) if kv is not None else ("", "")  # (none: the whole request)
        self.kv.append(source)
        self.generated.append(list(generated))
        if source in self.cannot_load:
            async def failing():
                raise RequestFailed(grpc.StatusCode.FAILED_PRECONDITION, "its prompt's KV could not be loaded")
                yield  # pragma: no cover
            return FakeStream(failing())
        return FakeStream(self._outputs(prompt, sampling, len(generated)))


def generate(replicas: ReplicaSet, max_tokens: int = 6) -> list[int]:
    async def go():
        gen = Generation(EngineRequest("r", list(PROMPT), SamplingParams(max_tokens=max_tokens, ignore_eos=True)))
        return [t for reply in [r async for r in dispatch(gen, replicas)] for t in reply.token_ids]
    return asyncio.run(asyncio.wait_for(go(), 30))


def mesh(*replicas) -> ReplicaSet:
    s = ReplicaSet([], LeastLoad())
    s.replicas = list(replicas)
    return s


def test_a_kv_load_failure_prefills_the_prompt_again_on_another_prefill_replica():
    p0, p1, d = Prefill("prefill:0"), Prefill("prefill:1"), Decode()
    want = list(range(8, 14))
    assert generate(mesh(p0, p1, d)) == want  # (the tokens, without any failure)
    first = p0 if p0.submitted else p1
    other = p1 if first is p0 else p0
    first.submitted.clear()
    d.cannot_load = {(first.address, "r"), (other.address, "r")}  # the first prefill of each replica
    d.kv.clear()
    assert generate(mesh(first, other, d)) == want  # no gap, no repeat: the retry's own token is not streamed
    assert [x[0] for x in first.submitted] == ["r"] and [x[0] for x in other.submitted] == ["r-kvretry1"]
    assert d.kv == [(first.address, "r"), (other.address, "r-kvretry1")]
    assert d.generated[-2:] == [[8], [8]]  # both decode legs go on from the client's first token
    assert first.released == ["r"]  # the KV the decode replica could not load: freed by the router too


def test_a_second_kv_load_failure_is_the_clients_error():
    p, d = Prefill("prefill:0"), Decode()
    d.cannot_load = {(p.address, "r"), (p.address, "r-kvretry1")}
    with pytest.raises(APIError) as failed:
        generate(mesh(p, d))
    assert failed.value.status == 503 and "could not load the prompt's KV (prefilled 2 times)" in str(failed.value)
    assert [x[0] for x in p.submitted] == ["r", "r-kvretry1"]  # (one prefill replica: it again)
    assert sorted(p.released) == ["r", "r-kvretry1"]


def test_a_prefill_replica_that_stops_passing_health_checks_is_left():
    p, d = Prefill("prefill:0"), Decode()
    p.stall = True

    async def go():
        gen = Generation(EngineRequest("r", list(PROMPT), SamplingParams(max_tokens=6, ignore_eos=True)))
        replicas = mesh(p, d)
        asyncio.get_running_loop().call_later(0.5, p.mark_failed, "DEADLINE_EXCEEDED: health check")
        return [t for reply in [r async for r in dispatch(gen, replicas)] for t in reply.token_ids]
    tokens = asyncio.run(asyncio.wait_for(go(), 10))
    assert tokens == list(range(8, 14))  # the whole request on the decode replica
    assert d.generated == [[]] and d.kv == [("", "")]


def test_a_client_gone_between_the_prefill_and_the_decode_has_the_kv_released():
    p, d = Prefill("prefill:0"), Decode()

    async def go():
        gen = Generation(EngineRequest("r", list(PROMPT), SamplingParams(max_tokens=6, ignore_eos=True)))
        replies = dispatch(gen, mesh(p, d))
        first = await replies.__anext__()  # the prefill's token: the client has it, then goes away
        await replies.aclose()
        await asyncio.sleep(0.1)
        return first.token_ids
    assert asyncio.run(go()) == [8]
    assert p.released == ["r"] and d.kv == []  # no decode replica was given it: the router freed it
