"""Continuous batching rules of the scheduler core, with made-up sampled tokens."""
from __future__ import annotations

import pytest

from scheduler import handover
from scheduler.config import SchedulerConfig
from scheduler.scheduler import QueueFull, Scheduler
from scheduler.status import Status
from stagemesh.core.engine_request import EngineRequest
from stagemesh.core.errors import StagemeshError
from stagemesh.core.sampling_params import SamplingParams
from stagemesh.core.step import PLACEHOLDER, SampledToken


def make(num_kv_blocks=64, **kw) -> Scheduler:
    kw.setdefault("max_model_len", 256)
    kw.setdefault("block_size", 4)
    kw.setdefault("eos_token_ids", (2,))
    return Scheduler(SchedulerConfig(num_kv_blocks=num_kv_blocks, **kw))


def run_step(s: Scheduler, token: int = 7):
    out = s.schedule()
    sampled = [SampledToken(c.seq_id, token) for c in out.step_batch.chunks if c.sample]
    return out, s.update_from_output(out, sampled)


def test_token_budget_chunks_prefill_and_puts_decodes_first():
    s = make(max_num_batched_tokens=10)
    s.add_request(EngineRequest("a", list(range(3, 9)), SamplingParams(max_tokens=5)))  # 6 tokens
    s.add_request(EngineRequest("b", list(range(3, 23)), SamplingParams(max_tokens=5)))  # 20 tokens
    out, _ = run_step(s)
    assert [len(c.token_ids) for c in out.step_batch.chunks] == [6, 4]
    assert [c.sample for c in out.step_batch.chunks] == [True, False]
    out, _ = run_step(s)
    # a's decode first, then 9 more of b's prompt
    assert [(c.token_ids, c.start_position) for c in out.step_batch.chunks][0] == ([7], 6)
    assert len(out.step_batch.chunks[1].token_ids) == 9
    assert out.num_preempted == 0 and out.step_batch.num_tokens <= 10


def test_in_flight_requests_are_not_scheduled_twice():
    s = make()
    s.add_request(EngineRequest("a", [3, 4, 5], SamplingParams(max_tokens=4)))
    s.add_request(EngineRequest("b", [3, 4, 5, 6], SamplingParams(max_tokens=4)))
    first = s.schedule()
    s.add_request(EngineRequest("c", [5, 6], SamplingParams(max_tokens=4)))
    second = s.schedule()  # micro-batch 2 while 1 is in flight: only c
    assert first.request_ids == ["a", "b"] and second.request_ids == ["c"]
    assert s.schedule() is None


def test_stop_rules_eos_stop_ids_length_and_ignore_eos():
    s = make()
    s.add_request(EngineRequest("eos", [3], SamplingParams(max_tokens=9)))
    s.add_request(EngineRequest("ign", [3], SamplingParams(max_tokens=2, ignore_eos=True)))
    s.add_request(EngineRequest("stop", [3], SamplingParams(max_tokens=9, stop_token_ids=(11,))))
    out = s.schedule()
    tokens = {"eos": 2, "ign": 2, "stop": 11}
    sampled = [SampledToken(c.seq_id, tokens[r]) for r, c in zip(out.request_ids, out.step_batch.chunks)]
    results = {r.request_id: r for r in s.update_from_output(out, sampled)}
    assert results["eos"].finish_reason == "stop" and results["eos"].stop_token_id == 2
    assert results["stop"].finish_reason == "stop" and results["stop"].stop_token_id == 11
    assert results["ign"].finish_reason is None
    _, results = run_step(s, token=2)
    assert results[0].finish_reason == "length"
    assert not s.has_unfinished() and s.kv.num_free_blocks == 64


def test_preemption_by_recompute_when_blocks_run_out():
    s = make(num_kv_blocks=4, block_size=4)
    s.add_request(EngineRequest("old", [3] * 7, SamplingParams(max_tokens=8, ignore_eos=True)))
    s.add_request(EngineRequest("new", [4] * 7, SamplingParams(max_tokens=8, ignore_eos=True)))
    run_step(s)  # both prefilled: 2 blocks each, pool full
    run_step(s)  # position 7 still fits the second block
    out, _ = run_step(s)  # old needs a third block for position 8: new is preempted
    assert out.num_preempted == 1
    assert [r.request_id for r in s.waiting] == ["new"] and s.requests["new"].status is Status.PREEMPTED
    preempted_seq = s.requests["new"].seq_id
    while "old" in s.requests:
        run_step(s)
    out, _ = run_step(s)
    [seq] = out.step_batch.new_sequences
    assert seq.output_token_ids == [7, 7]  # resumed with what it had generated
    assert out.step_batch.chunks[0].token_ids == [4] * 7 + [7, 7]  # everything recomputed
    assert preempted_seq not in [seq.seq_id]


def test_abort_frees_blocks_at_once_and_tells_stages():
    s = make()
    s.add_request(EngineRequest("a", list(range(3, 20)), SamplingParams(max_tokens=4)))
    out = s.schedule()
    used = s.kv.num_free_blocks
    [result] = s.abort(["a"])
    assert result.finish_reason == "abort" and s.kv.num_free_blocks == 64 > used
    assert s.update_from_output(out, [SampledToken(out.step_batch.chunks[0].seq_id, 7)]) == []
    s.add_request(EngineRequest("b", [3], SamplingParams(max_tokens=1)))
    assert s.schedule().step_batch.finished_seq_ids == [out.step_batch.chunks[0].seq_id]


def test_prefix_cache_hit_skips_cached_blocks():
    s = make(block_size=4)
    prompt = list(range(3, 16))  # 13 tokens: 3 full blocks
    s.add_request(EngineRequest("a", prompt, SamplingParams(max_tokens=1)))
    run_step(s)
    s.add_request(EngineRequest("b", prompt[:12] + [99], SamplingParams(max_tokens=1)))
    out, results = run_step(s)
    assert out.step_batch.chunks[0].start_position == 12 and out.step_batch.chunks[0].token_ids == [99]
    assert results[0].num_cached_tokens == 12
    assert s.stats().prefix_cache_hits == 12


def test_requests_that_cannot_fit_are_refused_with_the_numbers():
    s = make(max_model_len=32, max_waiting_requests=1)
    with pytest.raises(StagemeshError, match=r"maximum context length is 32 tokens.*40 \(30 in the prompt \+ 10"):
        s.add_request(EngineRequest("long", [3] * 30, SamplingParams(max_tokens=10)))
    s.add_request(EngineRequest("a", [3], SamplingParams()))
    with pytest.raises(QueueFull):
        s.add_request(EngineRequest("b", [3], SamplingParams()))


def test_fail_all_ends_every_request_with_the_error():
    s = make()
    s.add_request(EngineRequest("a", [3], SamplingParams()))
    s.add_request(EngineRequest("b", [4], SamplingParams()))
    s.schedule()
    results = s.fail_all("stage 1 at 127.0.0.1:5 failed")
    assert {r.finish_reason for r in results} == {"error"} and not s.has_unfinished()
    assert s.kv.num_free_blocks == 64


def test_max_seqs_caps_a_micro_batch_so_the_next_one_has_work():
    s = make()
    for i in range(4):
        s.add_request(EngineRequest(f"r{i}", [3, 4, 5], SamplingParams(max_tokens=4)))
    first, second = s.schedule(max_seqs=2), s.schedule(max_seqs=2)
    assert first.request_ids == ["r0", "r1"] and second.request_ids == ["r2", "r3"]


def test_blocks_filled_by_decoding_serve_as_a_cached_prefix():
    s = make(block_size=4, max_num_batched_tokens=3)  # the prompt comes in chunks of 3: they straddle blocks
    s.add_request(EngineRequest("a", [3, 4, 5, 6, 8], SamplingParams(max_tokens=6, ignore_eos=True)))
    generated = []
    while s.has_unfinished():
        generated += [t for r in run_step(s, token=9)[1] for t in r.new_token_ids]
    assert generated == [9] * 6
    # a's 11 tokens filled two blocks (the second one while decoding)
    s.add_request(EngineRequest("b", [3, 4, 5, 6, 8, 9, 9, 9, 1, 1], SamplingParams(max_tokens=1)))
    out, _ = run_step(s)
    assert out.step_batch.chunks[0].start_position == 8 and out.step_batch.chunks[0].token_ids == [1, 1]


def test_async_scheduling_runs_one_step_ahead_with_placeholders():
    s = make(async_scheduling=True)
    s.add_request(EngineRequest("a", [3, 4, 5, 6], SamplingParams(max_tokens=3)))
    first = s.schedule()  # the prompt, sampling its first token
    ahead = s.schedule()  # before that token is back: a decode of the placeholder
    assert [(c.token_ids, c.start_position, c.sample) for c in ahead.step_batch.chunks] == [([PLACEHOLDER], 4, True)]
    assert s.schedule() is None  # one step ahead at most
    assert ahead.step_batch.chunks.new_block_ids == [s.kv.tables["a"][1]]  # position 4 opens the second block
    [r] = s.update_from_output(first, [SampledToken(first.step_batch.chunks.seq_ids[0], 10)])
    assert r.new_token_ids == [10] and not r.finished
    # its third token would be the last one (max_tokens=3): no step ahead of that
    last = s.schedule()
    assert [(c.token_ids, c.start_position) for c in last.step_batch.chunks] == [([PLACEHOLDER], 5)]
    s.update_from_output(ahead, [SampledToken(ahead.step_batch.chunks.seq_ids[0], 11)])
    assert s.schedule() is None
    [r] = s.update_from_output(last, [SampledToken(last.step_batch.chunks.seq_ids[0], 12)])
    assert r.finish_reason == "length" and s.requests == {}


def test_async_scheduling_drops_the_step_ahead_of_a_request_that_stopped():
    s = make(async_scheduling=True)
    s.add_request(EngineRequest("a", [3, 4, 5], SamplingParams(max_tokens=9)))
    s.add_request(EngineRequest("b", [3, 4], SamplingParams(max_tokens=9)))
    first, ahead = s.schedule(), s.schedule()
    seq = dict(zip(first.request_ids, first.step_batch.chunks.seq_ids))
    outs = s.update_from_output(first, [SampledToken(seq["a"], 2), SampledToken(seq["b"], 7)])  # a hits EOS
    assert [(o.request_id, o.finish_reason) for o in outs] == [("a", "stop"), ("b", None)]
    nxt = s.schedule()  # b again, ahead of its step in flight; the stages drop a
    assert nxt.request_ids == ["b"] and nxt.step_batch.finished_seq_ids == [seq["a"]]
    outs = s.update_from_output(ahead, [SampledToken(seq["a"], 9), SampledToken(seq["b"], 8)])
    assert [(o.request_id, o.new_token_ids) for o in outs] == [("b", [8])]  # a's token computed ahead is dropped
    assert s.requests["b"].output_token_ids == [7, 8] and "a" not in s.kv.tables


def test_async_scheduling_caches_only_blocks_whose_tokens_are_known():
    s = make(async_scheduling=True, block_size=4)
    s.add_request(EngineRequest("a", [3, 4, 5], SamplingParams(max_tokens=9, ignore_eos=True)))
    first, ahead = s.schedule(), s.schedule()  # prompt (positions 0-2), then position 3 ahead
    seq = first.step_batch.chunks.seq_ids[0]
    s.update_from_output(first, [SampledToken(seq, 6)])
    assert s.kv.cached == {}  # block 0 is full only once position 3's step, in flight, is taken in
    s.schedule()
    s.update_from_output(ahead, [SampledToken(seq, 7)])
    assert s.kv.find_cached_prefix([3, 4, 5, 6, 99]) == [s.kv.tables["a"][0]]


def test_a_step_ahead_never_preempts():
    s = make(num_kv_blocks=2, block_size=2, max_num_batched_tokens=2, async_scheduling=True,
             enable_prefix_caching=False)
    s.add_request(EngineRequest("a", [3], SamplingParams(max_tokens=3, ignore_eos=True)))
    s.add_request(EngineRequest("c", [4, 5], SamplingParams(max_tokens=2, ignore_eos=True)))
    first = s.schedule()  # a's prompt, and the first of c's two prompt tokens (the budget is 2 tokens)
    assert first.request_ids == ["a", "c"] and first.step_batch.chunks.sample == [True, False]
    ahead = s.schedule()
    assert ahead.request_ids == ["a"]  # c's prompt is not done: nothing to run ahead of
    s.update_from_output(first, [SampledToken(first.step_batch.chunks.seq_ids[0], 7)])
    # a's next step ahead needs a third block: c, not in flight, holds the other one; c goes on instead
    third = s.schedule()
    assert third.request_ids == ["c"] and s.num_preemptions == 0


def test_a_request_whose_row_failed_to_sample_ends_alone_as_its_own_fault():
    s = make()
    for r in ("a", "b"):
        s.add_request(EngineRequest(r, [3, 4], SamplingParams(max_tokens=5)))
    out = s.schedule()
    seq_a, seq_b = out.step_batch.chunks.seq_ids
    results = {r.request_id: r for r in s.update_from_output(out, [SampledToken(seq_a, 7),
                                                                   SampledToken(seq_b, 0, error="not finite")])}
    assert results["b"].finish_reason == "error" and results["b"].own_fault and "not finite" in results["b"].error
    assert results["a"].new_token_ids == [7] and results["a"].finish_reason is None
    assert s.num_unfinished == 1
    out = s.schedule()
    assert out.request_ids == ["a"] and out.step_batch.finished_seq_ids == [seq_b]  # the stages drop b


@pytest.mark.parametrize("request_id,prompt,params,words", [
    ("x", [3, 384], SamplingParams(), "token id 384 in 'prompt_token_ids' is outside the vocabulary of 384"),
    ("x", [-1, 3], SamplingParams(), "token id -1"),
    ("x", [3], SamplingParams(stop_token_ids=(999,)), "token id 999 in 'stop_token_ids'"),
    ("y" * 300, [3], SamplingParams(), "1 to 256 characters"),
    ("", [3], SamplingParams(), "1 to 256 characters"),
])
def test_requests_with_ids_outside_the_vocabulary_are_refused(request_id, prompt, params, words):
    s = make(vocab_size=384)
    with pytest.raises(StagemeshError, match=words):
        s.add_request(EngineRequest(request_id, prompt, params))
    assert s.num_unfinished == 0


def priority_scheduler(num_kv_blocks=4, **kw) -> Scheduler:
    return make(num_kv_blocks=num_kv_blocks, scheduling_policy="priority", **kw)


def test_fcfs_refuses_a_priority_as_vllm_does_and_a_priority_must_be_int32():
    s = make()
    s.add_request(EngineRequest("zero", [3], SamplingParams(max_tokens=1), priority=0))
    with pytest.raises(StagemeshError, match="Got priority 3 but Priority scheduling is not enabled"):
        s.add_request(EngineRequest("three", [3], SamplingParams(max_tokens=1), priority=3))
    for bad in (2**31, True, 1.5):
        with pytest.raises(StagemeshError, match="priority must be a 32-bit integer"):
            priority_scheduler().add_request(EngineRequest("x", [3], SamplingParams(max_tokens=1), priority=bad))
    assert list(s.requests) == ["zero"]
    with pytest.raises(StagemeshError, match="scheduling-policy must be fcfs or priority"):
        make(scheduling_policy="lifo")


def test_priority_admits_lower_values_first_and_ties_in_arrival_order():
    s = priority_scheduler(num_kv_blocks=64, max_num_seqs=1)
    for request_id, priority in (("late", 5), ("urgent", -2), ("first0", 0), ("second0", 0)):
        s.add_request(EngineRequest(request_id, [3, 4], SamplingParams(max_tokens=1), priority=priority))
    order = []
    while s.has_unfinished():
        out, _ = run_step(s)
        order += out.request_ids
    assert order == ["urgent", "first0", "second0", "late"]
    fcfs = make(max_num_seqs=1)
    for request_id in ("a", "b", "c"):
        fcfs.add_request(EngineRequest(request_id, [3, 4], SamplingParams(max_tokens=1)))
    assert [run_step(fcfs)[0].request_ids[0] for _ in range(3)] == ["a", "b", "c"]


@pytest.mark.parametrize("policy,victim", [("fcfs", "high"), ("priority", "low")])
def test_the_victim_when_blocks_run_out_is_the_newest_or_the_lowest_priority(policy, victim):
    # "low" (priority 5) came first, "high" (priority 0) second; both need a third block at position 8
    s = make(num_kv_blocks=4, block_size=4, scheduling_policy=policy)
    priorities = {"low": 5, "high": 0} if policy == "priority" else {"low": 0, "high": 0}
    for request_id in ("low", "high"):
        s.add_request(EngineRequest(request_id, [3] * 7, SamplingParams(max_tokens=8, ignore_eos=True),
                                    priority=priorities[request_id]))
    run_step(s)
    run_step(s)
    out, _ = run_step(s)
    assert out.num_preempted == 1 and [r.request_id for r in s.waiting] == [victim]
    assert victim not in out.request_ids and s.requests[victim].num_preemptions == 1


def test_a_waiting_request_of_higher_priority_preempts_the_lowest_running_one():
    s = priority_scheduler(num_kv_blocks=4, block_size=4)
    for request_id, priority, token in (("mid", 3, 3), ("low", 9, 5)):
        s.add_request(EngineRequest(request_id, [token] * 7, SamplingParams(max_tokens=9, ignore_eos=True),
                                    priority=priority))
    run_step(s)  # both prefilled: the pool is full
    s.add_request(EngineRequest("high", [4] * 3, SamplingParams(max_tokens=2, ignore_eos=True), priority=1))
    out, _ = run_step(s)  # "high" needs a block: "low" (below it) is preempted, "high" admitted at once
    assert out.num_preempted == 1 and [r.request_id for r in s.waiting] == ["low"]
    assert out.request_ids == ["mid", "high"] and [r.request_id for r in s.running] == ["high", "mid"]


def test_a_tie_in_priority_preempts_nobody():
    s = priority_scheduler(num_kv_blocks=3, block_size=4)
    s.add_request(EngineRequest("first", [3] * 9, SamplingParams(max_tokens=3, ignore_eos=True), priority=1))
    run_step(s)  # the pool is full
    s.add_request(EngineRequest("same", [4] * 3, SamplingParams(max_tokens=2), priority=1))
    out, _ = run_step(s)
    assert out.num_preempted == 0 and out.request_ids == ["first"] and [r.request_id for r in s.waiting] == ["same"]
    s.add_request(EngineRequest("above", [5] * 3, SamplingParams(max_tokens=2), priority=0))
    out, _ = run_step(s)
    assert out.num_preempted == 1 and out.request_ids == ["above"]
    assert [r.request_id for r in s.waiting] == ["first", "same"]  # ties by arrival


def test_a_waiting_request_never_preempts_a_request_in_flight_or_under_fcfs():
    s = priority_scheduler(num_kv_blocks=3, block_size=4)
    s.add_request(EngineRequest("low", [3] * 9, SamplingParams(max_tokens=3, ignore_eos=True), priority=9))
    in_flight = s.schedule()  # "low" holds every block and its step is not back
    s.add_request(EngineRequest("high", [4] * 3, SamplingParams(max_tokens=2), priority=0))
    assert s.schedule() is None and [r.request_id for r in s.running] == ["low"]
    s.update_from_output(in_flight, [SampledToken(in_flight.step_batch.chunks[0].seq_id, 7)])
    out = s.schedule()  # its result is back: now it can be preempted
    assert out.num_preempted == 1 and out.request_ids == ["high"]
    fcfs = make(num_kv_blocks=3, block_size=4)
    fcfs.add_request(EngineRequest("old", [3] * 9, SamplingParams(max_tokens=3, ignore_eos=True)))
    run_step(fcfs)
    fcfs.add_request(EngineRequest("new", [4] * 3, SamplingParams(max_tokens=2)))
    out, _ = run_step(fcfs)
    assert out.num_preempted == 0 and out.request_ids == ["old"]


def test_requeued_requests_keep_their_priority_order_through_a_broken_pipeline():
    s = priority_scheduler(num_kv_blocks=64)
    for request_id, priority in (("b", 2), ("a", 1), ("c", 3)):
        s.add_request(EngineRequest(request_id, [3, 4], SamplingParams(max_tokens=4), priority=priority))
    run_step(s)
    s.add_request(EngineRequest("z", [3, 4], SamplingParams(max_tokens=4), priority=0))
    kept = handover.requeue_all(s)
    fresh = priority_scheduler(num_kv_blocks=64)
    handover.take_over(fresh, s)
    assert [r.request_id for r in fresh.waiting] == ["z", "a", "b", "c"] and len(kept) == 4


def test_a_request_waiting_for_its_grammar_keeps_its_place_through_a_broken_pipeline_and_runs_once_compiled():
    """vLLM's WAITING_FOR_FSM: the request is passed over while its constraint compiles (the one behind it runs),
    still waits for it in the next epoch's scheduler, and runs first once it is compiled."""
    s = make()
    s.add_request(EngineRequest("g", [3, 4, 5], SamplingParams(max_tokens=4)))
    s.wait_for_grammar("g", True)
    s.add_request(EngineRequest("p", [3, 4, 6], SamplingParams(max_tokens=4)))
    out, _ = run_step(s)
    assert out.request_ids == ["p"] and s.requests["g"].status is Status.WAITING_FOR_GRAMMAR
    handover.requeue_all(s)
    fresh = make()
    handover.take_over(fresh, s)
    out, _ = run_step(fresh)
    assert out.request_ids == ["p"] and fresh.requests["g"].status is Status.WAITING_FOR_GRAMMAR
    fresh.wait_for_grammar("g", False)
    out, _ = run_step(fresh)
    assert out.request_ids == ["p", "g"] and fresh.requests["g"].status is Status.RUNNING


def _lora_scheduler(max_loras: int = 1) -> Scheduler:
    from scheduler.lora_table import LoRATable

    return make(lora=LoRATable(max_loras=max_loras, adapters={"a": "/a", "b": "/b", "c": "/c"}))


def test_a_request_whose_adapter_has_no_slot_lets_those_behind_it_run_then_runs_itself():
    """--max-loras 1 with adapter a running: b's request waits in its place while a base-model request behind it
    runs; a's requests keep coming, yet once the a that ran has ended b's request runs, then c's, before them."""
    s, adapters = _lora_scheduler(), {}

    def add(request_id: str, adapter: str, max_tokens: int = 4) -> None:
        adapters[request_id] = adapter
        s.add_request(EngineRequest(request_id, [3, 4, 5], SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                                    lora_name=adapter))

    for request_id, adapter in (("a1", "a"), ("b1", "b"), ("base", ""), ("c1", "c")):
        add(request_id, adapter, max_tokens=3 if request_id == "a1" else 4)
    out, _ = run_step(s)
    assert out.request_ids == ["a1", "base"]  # b1 and c1 wait, keeping their places
    assert [r.request_id for r in s.waiting] == ["b1", "c1"]
    assert s.requests["b1"].status is s.requests["c1"].status is Status.WAITING_FOR_LORA_SLOT
    assert s.stats().waiting_adapters == ("b", "c") and s.stats().running_adapters == ("a",)
    started: dict[str, int] = {}
    for step in range(1, 100):
        if step <= 5:  # a's requests keep coming while b1 waits: they must not take its turn
            add(f"a-late{step}", "a")
        out, _ = run_step(s)
        for request_id in out.request_ids:
            started.setdefault(request_id, step)
        assert len({adapters[r] for r in out.request_ids} - {""}) <= 1  # one adapter at a time
        if not s.has_unfinished():
            break
    assert not s.has_unfinished(), "a request starved"
    assert started["b1"] < started["c1"] < min(started[f"a-late{i}"] for i in range(1, 6)), started
