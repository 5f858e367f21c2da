"""Continuous batching rules of the scheduler core, with made-up sampled tokens."""
from __future__ import annotations

import pytest

from scheduler.config import SchedulerConfig
from scheduler.scheduler import QueueFull, Scheduler
from stagemesh.errors import StagemeshError
from stagemesh.sampling_params import SamplingParams
from stagemesh.step import SampledToken


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
    s.add_request("a", list(range(3, 9)), SamplingParams(max_tokens=5))  # 6 tokens
    s.add_request("b", list(range(3, 23)), SamplingParams(max_tokens=5))  # 20 tokens
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
    s.add_request("a", [3, 4, 5], SamplingParams(max_tokens=4))
    s.add_request("b", [3, 4, 5, 6], SamplingParams(max_tokens=4))
    first = s.schedule()
    s.add_request("c", [5, 6], SamplingParams(max_tokens=4))
    second = s.schedule()  # micro-batch 2 while 1 is in flight: only c
    assert first.request_ids == ["a", "b"] and second.request_ids == ["c"]
    assert s.schedule() is None


def test_stop_rules_eos_stop_ids_length_and_ignore_eos():
    s = make()
    s.add_request("eos", [3], SamplingParams(max_tokens=9))
    s.add_request("ign", [3], SamplingParams(max_tokens=2, ignore_eos=True))
    s.add_request("stop", [3], SamplingParams(max_tokens=9, stop_token_ids=(11,)))
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
    s.add_request("old", [3] * 7, SamplingParams(max_tokens=8, ignore_eos=True))
    s.add_request("new", [4] * 7, SamplingParams(max_tokens=8, ignore_eos=True))
    run_step(s)  # both prefilled: 2 blocks each, pool full
    run_step(s)  # position 7 still fits the second block
    out, _ = run_step(s)  # old needs a third block for position 8: new is preempted
    assert out.num_preempted == 1
    assert [r.request_id for r in s.waiting] == ["new"]
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
    s.add_request("a", list(range(3, 20)), SamplingParams(max_tokens=4))
    out = s.schedule()
    used = s.kv.num_free_blocks
    [result] = s.abort(["a"])
    assert result.finish_reason == "abort" and s.kv.num_free_blocks == 64 > used
    assert s.update_from_output(out, [SampledToken(out.step_batch.chunks[0].seq_id, 7)]) == []
    s.add_request("b", [3], SamplingParams(max_tokens=1))
    assert s.schedule().step_batch.finished_seq_ids == [out.step_batch.chunks[0].seq_id]


def test_prefix_cache_hit_skips_cached_blocks():
    s = make(block_size=4)
    prompt = list(range(3, 16))  # 13 tokens: 3 full blocks
    s.add_request("a", prompt, SamplingParams(max_tokens=1))
    run_step(s)
    s.add_request("b", prompt[:12] + [99], SamplingParams(max_tokens=1))
    out, results = run_step(s)
    assert out.step_batch.chunks[0].start_position == 12 and out.step_batch.chunks[0].token_ids == [99]
    assert results[0].num_cached_tokens == 12
    assert s.stats().prefix_cache_hits == 12


def test_requests_that_cannot_fit_are_refused_with_the_numbers():
    s = make(max_model_len=32, max_waiting_requests=1)
    with pytest.raises(StagemeshError, match=r"maximum context length is 32 tokens.*40 \(30 in the prompt \+ 10"):
        s.add_request("long", [3] * 30, SamplingParams(max_tokens=10))
    s.add_request("a", [3], SamplingParams())
    with pytest.raises(QueueFull):
        s.add_request("b", [3], SamplingParams())


def test_fail_all_ends_every_request_with_the_error():
    s = make()
    s.add_request("a", [3], SamplingParams())
    s.add_request("b", [4], SamplingParams())
    s.schedule()
    results = s.fail_all("stage 1 at 127.0.0.1:5 failed")
    assert {r.finish_reason for r in results} == {"error"} and not s.has_unfinished()
    assert s.kv.num_free_blocks == 64


def test_max_seqs_caps_a_micro_batch_so_the_next_one_has_work():
    s = make()
    for i in range(4):
        s.add_request(f"r{i}", [3, 4, 5], SamplingParams(max_tokens=4))
    first, second = s.schedule(max_seqs=2), s.schedule(max_seqs=2)
    assert first.request_ids == ["r0", "r1"] and second.request_ids == ["r2", "r3"]


def test_blocks_filled_by_decoding_serve_as_a_cached_prefix():
    s = make(block_size=4, max_num_batched_tokens=3)  # the prompt comes in chunks of 3: they straddle blocks
    s.add_request("a", [3, 4, 5, 6, 8], SamplingParams(max_tokens=6, ignore_eos=True))
    generated = []
    while s.has_unfinished():
        generated += [t for r in run_step(s, token=9)[1] for t in r.new_token_ids]
    assert generated == [9] * 6
    # a's 11 tokens filled two blocks (the second one while decoding)
    s.add_request("b", [3, 4, 5, 6, 8, 9, 9, 9, 1, 1], SamplingParams(max_tokens=1))
    out, _ = run_step(s)
    assert out.step_batch.chunks[0].start_position == 8 and out.step_batch.chunks[0].token_ids == [1, 1]
