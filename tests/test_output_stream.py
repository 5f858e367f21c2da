"""Outputs queued for a slow request stream merge; errors come on their own."""
from __future__ import annotations

import asyncio

from scheduler.output_stream import OutputStream
from scheduler.request import RequestOutput
from stagemesh.core.step import SampledToken


def drain(*outputs: RequestOutput) -> list[RequestOutput]:
    async def run():
        stream, got = OutputStream(), []
        for out in outputs:
            stream.put(out)
        while not got or not got[-1].finished:
            got.append(await stream.get())
        return got

    return asyncio.run(run())


def test_pending_outputs_merge_in_order():
    a = RequestOutput("r", [5], [SampledToken(0, 5, -0.1)], num_prompt_tokens=3, num_cached_tokens=2)
    b = RequestOutput("r", [6], [SampledToken(0, 6, -0.2)], num_prompt_tokens=3, num_cached_tokens=2)
    c = RequestOutput("r", [7], [SampledToken(0, 7, -0.3)], finish_reason="stop", stop_token_id=7)
    (out,) = drain(a, b, c)
    assert out.new_token_ids == [5, 6, 7] and [t.token_id for t in out.new_logprobs] == [5, 6, 7]
    assert (out.finish_reason, out.stop_token_id) == ("stop", 7)
    assert (out.num_prompt_tokens, out.num_cached_tokens) == (3, 2)


def test_an_error_is_not_merged_into_tokens():
    got = drain(RequestOutput("r", [5]), RequestOutput("r", [6]), RequestOutput("r", finish_reason="error",
                                                                               error="stage 1 failed"))
    assert [o.new_token_ids for o in got] == [[5, 6], []]
    assert got[1].error == "stage 1 failed"


def test_a_reader_that_keeps_up_gets_each_output():
    async def run():
        stream = OutputStream()
        stream.put(RequestOutput("r", [1]))
        first = await stream.get()
        stream.put(RequestOutput("r", [2], finish_reason="length"))
        return first, await stream.get()

    first, second = asyncio.run(run())
    assert first.new_token_ids == [1] and second.new_token_ids == [2] and second.finish_reason == "length"
