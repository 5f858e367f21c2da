"""The replica's driver as a unit: epochs, run-ahead, replies out of order, stages that fail or answer
nonsense. A fake pipeline answers when the test says (its "model" samples, at each position, a token
that is a function of the position), and the in-process pipeline runs a tiny model against transformers.
No processes, no gRPC: seconds."""
from __future__ import annotations

import asyncio

import pytest

from scheduler.config import SchedulerConfig
from scheduler.driver import Driver, DriverConfig, Unavailable
from scheduler.output_stream import OutputStream
from scheduler.pipeline import StageFailure, StepResult
from scheduler.rendezvous import ModelIdentity, PipelinePlan, StageInfo
from scheduler.scheduler import Scheduler
from stagemesh.core.engine_request import EngineRequest
from stagemesh.core.errors import StagemeshError
from stagemesh.core.sampling_params import SamplingParams
from stagemesh.core.step import PLACEHOLDER, SampledToken, StepBatch

VOCAB = 100
MODEL = ModelIdentity("fake", 4, 8, VOCAB, 2, 2)


def token_at(position: int) -> int:
    """The fake model's token at `position` of a sequence."""
    return position % 89 + 3


def want(prompt_len: int, n: int) -> list[int]:
    return [token_at(prompt_len + k) for k in range(n)]


class FakePipeline:
    """Computes each step when it is sent, in step order as a stage does; answers at once (auto) or when
    the test calls answer(), in any order, as replies on the wire may come."""
    block_size = 4

    def __init__(self, num_stages: int = 1, overlaps: bool = True, auto: bool = True, num_kv_blocks: int = 64):
        self.num_stages, self.overlaps_stages, self.auto = num_stages, overlaps, auto
        stages = [StageInfo(i, i, i + 1, 1, "cpu", num_kv_blocks, 4, MODEL, f"fake:{i}", "fake")
                  for i in range(num_stages)]
        self.plan = PipelinePlan(stages, num_stages, list(range(num_stages)), [1] * num_stages, num_kv_blocks)
        self.sent: list[tuple[int, StepBatch, asyncio.Future]] = []
        self.results: list[StepResult] = []
        self.joined: list[int] = []
        self.probe_result: StageFailure | None = None
        self.fail_join: StageFailure | None = None
        self.lengths: dict[int, int] = {}  # seq_id -> tokens computed, as a stage tracks them
        self.compiled: list = []  # the constraints the last stage was asked to compile

    def layout(self) -> PipelinePlan:
        return self.plan

    async def join(self, epoch, plan, max_model_len, max_num_batched_tokens) -> None:
        if self.fail_join is not None:
            raise self.fail_join
        self.joined.append(epoch)
        self.lengths.clear()

    async def compile_grammar(self, structured, timeout_s) -> None:
        self.compiled.append(structured)

    def forward(self, epoch, batch, span, trace_links) -> asyncio.Future:
        future = asyncio.get_running_loop().create_future()
        self.sent.append((epoch, batch, future))
        self.results.append(self.result(batch))
        if self.auto:
            self.answer(len(self.sent) - 1)
        return future

    def result(self, batch: StepBatch) -> StepResult:
        c = batch.chunks
        for seq_id in batch.finished_seq_ids:
            self.lengths.pop(seq_id, None)
        sampled = []
        for seq_id, start, n, sample in zip(c.seq_ids, c.start_positions, c.num_tokens, c.sample):
            assert start == self.lengths.get(seq_id, 0), "a chunk does not continue its sequence"
            self.lengths[seq_id] = start + n
            if sample:
                sampled.append(SampledToken(seq_id, token_at(start + n)))
        return StepResult(sampled, compute_seconds=0.001)

    def answer(self, index: int, failure: StageFailure | None = None, result: StepResult | None = None) -> None:
        future = self.sent[index][2]
        if failure is not None:
            future.set_exception(failure)
        else:
            future.set_result(result or self.results[index])

    async def probe(self) -> StageFailure | None:
        return self.probe_result


def make_driver(pipeline, recovery_s: float = 0.0, retries: int = 3, async_scheduling: bool | None = None,
                warm_up: bool = False, **scheduler) -> Driver:
    """A driver over `pipeline`; recovery_s 0: a broken pipeline fails its requests at once."""
    scheduler.setdefault("block_size", 4)
    return Driver(DriverConfig(SchedulerConfig(vocab_size=VOCAB, **scheduler), model_max_len=256,
                               probe_interval_s=0.01, stage_recovery_timeout_s=recovery_s,
                               max_request_retries=retries, async_scheduling=async_scheduling, warm_up=warm_up),
                  pipeline)


async def collect(stream: OutputStream) -> tuple[list[int], str | None, str | None]:
    tokens = []
    while True:
        out = await stream.get()
        tokens += out.new_token_ids
        if out.finished:
            return tokens, out.finish_reason, out.error


def start(driver: Driver, name: str, prompt: list[int], n: int, generated: list[int] = (), **sampling
          ) -> asyncio.Task:
    stream = OutputStream()
    sampling_params = SamplingParams(max_tokens=n, ignore_eos=True, **sampling)
    driver.add(EngineRequest(name, prompt, sampling_params, generated), stream)
    return asyncio.create_task(collect(stream))


async def with_driver(driver: Driver, body):
    await driver.form()
    loop = asyncio.create_task(driver.run())
    try:
        return await asyncio.wait_for(body(), 20)
    finally:
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)
        await driver.close()


def test_steps_flow_and_tokens_reach_their_requests():
    pipeline = FakePipeline(num_stages=2)
    driver = make_driver(pipeline)

    async def body():
        a, b, c = (start(driver, f"r{i}", list(range(5, 5 + n)), 6) for i, n in enumerate((3, 10, 7)))
        return await asyncio.gather(a, b, c)

    results = asyncio.run(with_driver(driver, body))
    assert results == [(want(3, 6), "length", None), (want(10, 6), "length", None), (want(7, 6), "length", None)]
    assert pipeline.joined == [1]
    # two stages in separate processes: two micro-batches share the requests
    assert max(len(b.chunks) for _, b, _ in pipeline.sent) < 3


def test_a_new_pipeline_warms_up_before_it_serves_and_leaves_nothing_behind():
    pipeline = FakePipeline(num_stages=2)
    driver = make_driver(pipeline, warm_up=True)

    async def body():
        warm = list(pipeline.sent)  # every step sent before the first request came
        assert driver.healthy and warm, "the pipeline served before any warm-up step"
        assert len(pipeline.compiled) == 1, "the last stage's constraint compiler was not made before serving"
        assert all(b.warmup for _, b, _ in warm)
        prompt = list(warm[0][1].new_sequences[0].prompt_token_ids)  # the warm-up's own prompt
        result = await start(driver, "r", prompt, 3)
        return warm, prompt, result, pipeline.sent[len(warm)][1]

    warm, prompt, result, first = asyncio.run(with_driver(driver, body))
    assert result == (want(len(prompt), 3), "length", None)
    warm_seqs = {seq for _, b, _ in warm for seq in b.chunks.seq_ids}
    assert len(warm_seqs) == 2 and any(len(b.chunks.seq_ids) == 2 and max(b.chunks.num_tokens) == 1
                                       for _, b, _ in warm), "no decode step at batch 2"
    # the stages drop the warm-up's sequences with the first real step, whose ids follow the warm-up's
    assert set(first.finished_seq_ids) == warm_seqs
    assert first.step_id > max(b.step_id for _, b, _ in warm) and not first.warmup
    assert not warm_seqs & {s.seq_id for s in first.new_sequences}
    # nothing the warm-up computed is a prefix-cache hit: the whole prompt was computed again
    assert first.chunks.start_positions[0] == 0 and driver.scheduler.stats().prefix_cache_hits == 0


def test_replies_out_of_order_are_taken_in_step_order():
    # one stage with async scheduling: a step runs ahead on the sequences of the step before it, so the
    # later reply overtaking the earlier one must not put its tokens first
    pipeline = FakePipeline(num_stages=1, auto=False)
    driver = Driver(DriverConfig(SchedulerConfig(vocab_size=VOCAB, block_size=4), model_max_len=256,
                                 async_scheduling=True, warm_up=False), pipeline)

    async def body():
        tasks = [start(driver, f"r{i}", [7] * (4 + i), 6) for i in range(2)]
        overtaken = 0
        while not all(t.done() for t in tasks):
            await asyncio.sleep(0.005)
            pending = [i for i, (_, _, f) in enumerate(pipeline.sent) if not f.done()]
            if len(pending) >= 2:
                pipeline.answer(pending[1])
                overtaken += 1
            if pending:
                pipeline.answer(pending[0])
        return overtaken, await asyncio.gather(*tasks)

    overtaken, results = asyncio.run(with_driver(driver, body))
    assert overtaken > 0
    assert results == [(want(4 + i, 6), "length", None) for i in range(2)]


def test_run_ahead_keeps_two_steps_in_flight_with_placeholders():
    pipeline = FakePipeline(num_stages=1)
    driver = Driver(DriverConfig(SchedulerConfig(vocab_size=VOCAB, block_size=4), model_max_len=256,
                                 async_scheduling=True, warm_up=False), pipeline)

    async def body():
        return await start(driver, "r", [9] * 6, 8)

    assert asyncio.run(with_driver(driver, body)) == (want(6, 8), "length", None)
    ahead = [b for _, b, _ in pipeline.sent if PLACEHOLDER in b.chunks.token_ids]
    assert ahead, "no step was scheduled ahead of its sequence's last token"


def test_a_failed_stage_fails_the_epoch_and_a_late_reply_is_ignored():
    pipeline = FakePipeline(num_stages=2, auto=False)
    driver = make_driver(pipeline)

    async def body():
        tasks = [start(driver, f"r{i}", [5] * 6, 4) for i in range(2)]
        while len(pipeline.sent) < 2:
            await asyncio.sleep(0.001)
        pipeline.answer(1, failure=StageFailure(pipeline.plan.stages[1], "UNAVAILABLE: gone"))
        results = await asyncio.gather(*tasks)
        assert not driver.healthy and "stage 1" in driver.reason
        with pytest.raises(Unavailable):
            driver.add(EngineRequest("late", [1, 2], SamplingParams(max_tokens=1)), OutputStream())
        pipeline.auto = True
        while not driver.healthy:  # the probe finds every stage answering: a new epoch forms
            await asyncio.sleep(0.01)
        # the request comes again (as a router's retry would, with its id); the broken epoch's other step
        # answers late: its tokens must not reach the new request
        again = start(driver, "r0", [5] * 9, 4)
        pipeline.answer(0)
        return results, await again

    results, again = asyncio.run(with_driver(driver, body))
    for _tokens, reason, error in results:
        assert reason == "error" and "stage 1" in error and "failed" in error
    assert again == (want(9, 4), "length", None)
    assert pipeline.joined == [1, 3]  # epoch 2 was the broken one's end


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["plain", "run-ahead"])
def test_a_failed_stage_keeps_its_requests_and_they_go_on_exactly_when_the_pipeline_reforms(async_scheduling):
    pipeline = FakePipeline(num_stages=1 if async_scheduling else 2, auto=False)
    driver = make_driver(pipeline, recovery_s=10, async_scheduling=async_scheduling)

    async def body():
        tasks = [start(driver, f"r{i}", [5] * (6 + i), 12) for i in range(3)]
        for k in range(4):  # a few tokens each, then the failure with steps in flight
            while len(pipeline.sent) <= k:
                await asyncio.sleep(0.001)
            pipeline.answer(k)
        while len(pipeline.sent) < 5:
            await asyncio.sleep(0.001)
        pipeline.probe_result = StageFailure(pipeline.plan.stages[-1], "UNAVAILABLE: killed")
        pipeline.answer(4, failure=pipeline.probe_result)
        while driver.healthy:
            await asyncio.sleep(0.001)
        assert "killed" in driver.reason and not any(t.done() for t in tasks)  # kept, stalled
        with pytest.raises(Unavailable):  # new requests go elsewhere meanwhile
            driver.add(EngineRequest("new", [1, 2], SamplingParams(max_tokens=1)), OutputStream())
        pipeline.auto, pipeline.probe_result = True, None  # the stage is back: a new epoch takes them over
        for i in range(5, len(pipeline.sent)):  # the broken epoch's late replies are ignored
            if not pipeline.sent[i][2].done():
                pipeline.answer(i)
        return await asyncio.gather(*tasks)

    results = asyncio.run(with_driver(driver, body))
    assert results == [(want(6 + i, 12), "length", None) for i in range(3)]  # no gap, no repeat
    assert len(pipeline.joined) == 2 and driver.healthy


def test_kept_requests_fail_with_the_stage_when_the_window_ends_or_after_too_many_failures():
    for recovery_s, retries, why in ((0.3, 3, "within"), (10, 0, "--max-request-retries 0")):
        pipeline = FakePipeline(num_stages=2, auto=False)
        driver = make_driver(pipeline, recovery_s=recovery_s, retries=retries)

        async def body():
            tasks = [start(driver, f"r{i}", [5] * 6, 4) for i in range(2)]
            while len(pipeline.sent) < 2:
                await asyncio.sleep(0.001)
            pipeline.probe_result = StageFailure(pipeline.plan.stages[1], "UNAVAILABLE: gone")  # never back
            pipeline.answer(1, failure=pipeline.probe_result)
            return await asyncio.gather(*tasks)

        results = asyncio.run(with_driver(driver, body))
        for _tokens, reason, error in results:
            assert reason == "error" and "stage 1 (fake:1, layers 1:2) failed: UNAVAILABLE: gone" in error
        if retries == 0:
            assert why in results[0][2]


def test_a_continuation_goes_on_from_the_tokens_generated_elsewhere():
    pipeline = FakePipeline(num_stages=2)
    driver = make_driver(pipeline)

    async def body():
        return await start(driver, "r", [5] * 7, 10, generated=want(7, 4))

    tokens, reason, error = asyncio.run(with_driver(driver, body))
    assert (tokens, reason) == (want(7, 10)[4:], "length")  # the remaining six: max_tokens counts the four
    with pytest.raises(StagemeshError, match="nothing left to generate"):
        Scheduler(SchedulerConfig(num_kv_blocks=8, max_model_len=64, block_size=4, vocab_size=VOCAB)).add_request(
            EngineRequest("x", [5], SamplingParams(max_tokens=2), [7, 8]))
    with pytest.raises(StagemeshError, match="generated_token_ids"):
        Scheduler(SchedulerConfig(num_kv_blocks=8, max_model_len=64, block_size=4, vocab_size=VOCAB)).add_request(
            EngineRequest("x", [5], SamplingParams(max_tokens=4), [VOCAB]))


def test_a_stage_that_answers_nonsense_is_a_failed_stage():
    for bad in ("seq_ids", "vocab"):
        pipeline = FakePipeline(num_stages=1, auto=False)
        driver = make_driver(pipeline)

        async def body():
            task = start(driver, "r", [5] * 6, 4)
            while not pipeline.sent:
                await asyncio.sleep(0.001)
            result = pipeline.results[0]
            if bad == "seq_ids":
                result.sampled[0].seq_id += 1
            else:
                result.sampled[0].token_id = VOCAB
            pipeline.answer(0, result=result)
            return await task

        tokens, reason, error = asyncio.run(with_driver(driver, body))
        assert reason == "error" and error.startswith("stage 0 (fake:0, layers 0:1) failed:")
        assert ("sampled sequences" if bad == "seq_ids" else "outside the vocabulary") in error


def test_a_row_that_cannot_be_sampled_fails_its_request_alone():
    pipeline = FakePipeline(num_stages=1, auto=False)
    driver = make_driver(pipeline)

    async def body():
        tasks = [start(driver, f"r{i}", [5] * 6, 4) for i in range(2)]
        while not pipeline.sent:
            await asyncio.sleep(0.001)
        result = pipeline.results[0]
        result.sampled[0].error = "probability tensor contains nan"
        pipeline.answer(0, result=result)
        pipeline.auto = True
        while len(pipeline.sent) < 2:
            await asyncio.sleep(0.001)
        for i in range(1, len(pipeline.sent)):
            if not pipeline.sent[i][2].done():
                pipeline.answer(i)
        return await asyncio.gather(*tasks)

    (t0, r0, e0), (t1, r1, e1) = asyncio.run(with_driver(driver, body))
    assert r0 == "error" and "nan" in e0
    assert (t1, r1) == (want(6, 4), "length") and driver.healthy


def test_a_pipeline_that_cannot_join_stays_unhealthy_with_the_reason():
    pipeline = FakePipeline()
    pipeline.fail_join = StageFailure(pipeline.plan.stages[0], "DEADLINE_EXCEEDED: join")
    driver = make_driver(pipeline)
    asyncio.run(driver.form())
    assert not driver.healthy and "did not form" in driver.reason and "DEADLINE_EXCEEDED" in driver.reason


def test_in_process_pipeline_matches_transformers_with_run_ahead(tiny_model_dir):
    from parity import prompts
    from stagemesh.entry.local_engine import LocalEngine
    from tiny_models import reference_model, reference_tokens

    model_dir = tiny_model_dir("llama")
    ref = reference_model(model_dir)
    batch = prompts(384, (5, 40, 17))
    expected = [reference_tokens(ref, p, 10) for p in batch]
    for split in ([4], [1, 3]):  # the last runner's tokens fill the first one's placeholders
        with LocalEngine.of(model_dir, layer_split=split, max_num_batched_tokens=16, async_scheduling=True) as engine:
            assert engine.generate(batch, SamplingParams(max_tokens=10, ignore_eos=True)) == expected
