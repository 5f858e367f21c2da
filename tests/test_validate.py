"""The rules every entry point checks: sampling values, steps, activations and a stage's sequence state.
A message that breaks one is refused with a reason before anything reaches a kernel."""
from __future__ import annotations

import math

import pytest

from stagemesh.core.errors import StagemeshError
from stagemesh.core.sampling_params import InvalidParameter, SamplingParams
from stagemesh.core.step import PLACEHOLDER, NewSequence, ScheduledChunks, StepBatch
from stagemesh.v1 import common_pb2
from stagemesh.core.wire import sampling_from_pb, sampling_to_pb
from stage_worker.runner import StageRunner
from stage_worker.validate import InvalidStep, StepLimits, check_activations, check_state, check_step

LIMITS = StepLimits(vocab_size=384, hidden_size=64, block_size=16, num_kv_blocks=100, max_model_len=128,
                    max_num_batched_tokens=64)


@pytest.mark.parametrize("kw,param", [
    ({"temperature": math.nan}, "temperature"), ({"temperature": math.inf}, "temperature"),
    ({"temperature": 2.5}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1e-46}, "top_p"),
    ({"top_k": 2**31}, "top_k"), ({"top_k": -2}, "top_k"), ({"min_p": -0.1}, "min_p"),
    ({"repetition_penalty": 1e30}, "repetition_penalty"), ({"presence_penalty": -3}, "presence_penalty"),
    ({"frequency_penalty": math.nan}, "frequency_penalty"), ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 2**31}, "max_tokens"), ({"seed": 2**63}, "seed"), ({"logprobs": 21}, "logprobs"),
    ({"stop_token_ids": (2**31,)}, "stop_token_ids"), ({"stop_token_ids": (-1,)}, "stop_token_ids"),
    ({"stop_token_ids": ("a",)}, "stop_token_ids"), ({"temperature": "hot"}, "temperature"),
    ({"temperature": 10**400}, "temperature"), ({"top_k": 10**400}, "top_k"),
])
def test_sampling_values_out_of_range_or_unrepresentable_are_refused_naming_them(kw, param):
    with pytest.raises(InvalidParameter) as err:
        SamplingParams(**kw)
    assert err.value.param == param and f"'{param}'" in str(err.value)


def test_tiny_temperatures_sample_greedily_and_values_are_what_the_wire_carries():
    for t in (1e-45, 1e-300, 0.0, 9e-6):
        assert SamplingParams(temperature=t).greedy
    assert not SamplingParams(temperature=1e-4).greedy
    p = SamplingParams(temperature=0.7, top_p=0.9, seed=-5, stop_token_ids=(3, 4))
    assert sampling_from_pb(sampling_to_pb(p)) == p  # float32 on the wire: stored as float32 already


def test_a_nan_from_the_wire_is_refused():
    msg = sampling_to_pb(SamplingParams())
    msg.top_p = math.nan
    with pytest.raises(InvalidParameter, match="'top_p'"):
        sampling_from_pb(msg)


def test_stop_token_ids_are_checked_against_the_vocabulary_where_it_is_known():
    p = SamplingParams(stop_token_ids=(5, 400))
    with pytest.raises(InvalidParameter, match="token id 400 in 'stop_token_ids' is outside the vocabulary of 384"):
        p.check_vocab(384)


def step(**columns) -> StepBatch:
    c = dict(seq_ids=[0], num_tokens=[3], token_ids=[5, 6, 7], start_positions=[0], num_new_blocks=[1],
             new_block_ids=[4], sample=[True])
    c.update(columns)
    new = [NewSequence(0, [5, 6, 7], SamplingParams())] if 0 in c["seq_ids"] else []
    return StepBatch(1, new, ScheduledChunks(**c))


@pytest.mark.parametrize("batch,words", [
    (step(start_positions=[10**6]), "outside [0, 128)"),
    (step(start_positions=[-16]), "outside [0, 128)"),
    (step(start_positions=[126]), "outside [0, 128)"),
    (step(new_block_ids=[100]), "outside the KV cache of 100 blocks"),
    (step(new_block_ids=[-1]), "outside the KV cache"),
    (step(num_new_blocks=[9], new_block_ids=list(range(9))), "more blocks than a sequence of 128 tokens holds"),
    (step(num_new_blocks=[2]), "num_new_blocks does not add up"),
    (step(num_tokens=[0], token_ids=[]), "a chunk has no token"),
    (step(num_tokens=[4]), "num_tokens does not add up"),
    (step(token_ids=[5, 6, 384]), "token id 384 is outside the vocabulary of 384"),
    (step(token_ids=[5, -2, 7]), "token id -2 is outside the vocabulary"),
    (step(token_ids=[5, PLACEHOLDER, 7]), "placeholder token stands elsewhere"),
    (step(seq_ids=[0, 0], num_tokens=[1, 2], start_positions=[0, 0], num_new_blocks=[1, 0], sample=[True, True]),
     "appears twice"),
    (step(sample=[True, False]), "columns differ in length"),
    (step(num_tokens=[65], token_ids=[5] * 65, num_new_blocks=[5], new_block_ids=[0, 1, 2, 3, 4]),
     "the step has 65 tokens; the pipeline allows 64"),
])
def test_steps_that_break_the_rules_are_refused(batch, words):
    with pytest.raises(InvalidStep, match=words.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        check_step(batch, LIMITS)


def test_a_good_step_and_a_step_ahead_pass():
    check_step(step(), LIMITS)
    check_step(step(token_ids=[5, 6, PLACEHOLDER]), LIMITS)


def test_before_a_join_nothing_is_allowed():
    with pytest.raises(InvalidStep, match="has not joined"):
        check_step(step(), StepLimits(384, 64, 16))


def activations(shape, dtype="float32", nbytes=None):
    size = 1
    for n in shape:
        size *= n
    return common_pb2.Tensor(dtype=dtype, shape=shape, data=b"\0" * (size * 4 if nbytes is None else nbytes))


@pytest.mark.parametrize("msg,words", [
    (activations([3, 64], nbytes=10), "need 768 bytes, got 10"),
    (activations([3, 32]), "this model's are [tokens, 64]"),
    (activations([3, 64], dtype="int64"), "dtype 'int64'"),
    (activations([3, 64], dtype="float16"), "need 384 bytes, got 768"),  # half the bytes of float32
    (activations([100, 64]), "a step has 1 to 64"),
    (activations([3, 64, 1]), "this model's are"),
])
def test_activations_that_do_not_fit_the_step_limits_are_refused(msg, words):
    with pytest.raises(InvalidStep, match=words.replace("[", r"\[").replace("]", r"\]")):
        check_activations(msg, LIMITS)


@pytest.fixture(scope="module")
def runner(tiny_model_dir):
    r = StageRunner.of(tiny_model_dir("llama"), 0, 4)
    r.allocate_kv_cache(100)
    return r


def test_state_checks_know_sequences_and_where_each_continues(runner):
    runner.execute(step())  # sequence 0 holds positions 0..2 in block 4
    cont = StepBatch(2, [], ScheduledChunks([0], [1], [9], [3], [0], [], [True]))
    check_state(runner, cont, 128)
    for bad, words in [
        (StepBatch(2, [], ScheduledChunks([0], [1], [9], [5], [0], [], [True])), "continues at position 5; its "
                                                                                     "tokens end at 3"),
        (StepBatch(2, [], ScheduledChunks([7], [1], [9], [0], [0], [], [True])), "sequence 7 is not known"),
        (StepBatch(2, [], ScheduledChunks([0], [14], [9] * 14, [3], [0], [], [True])), "has 1 KV blocks for 17"),
        (StepBatch(2, [NewSequence(0, [5], SamplingParams())], ScheduledChunks([0], [1], [5], [0], [1], [6],
                                                                                  [True])), "already in use"),
        (StepBatch(2, [NewSequence(3, [5] * 40, SamplingParams())],
                   ScheduledChunks([3], [1], [5], [32], [1], [6], [True])), "starts at 32 with 1 KV blocks"),
        (StepBatch(2, [NewSequence(3, [5], SamplingParams())], ScheduledChunks()), "without a chunk"),
        (StepBatch(2, [], ScheduledChunks([0], [1], [9], [3], [8], list(range(10, 18)), [True])),
         "would hold 9 KV blocks; 8 hold max_model_len"),
    ]:
        before = (dict(runner.seq_lens), {s: list(t) for s, t in runner.block_tables.items()})
        with pytest.raises(InvalidStep, match=words):
            check_state(runner, bad, 128)
        assert (runner.seq_lens, runner.block_tables) == before  # a refusal changes nothing
    runner.execute(cont)  # the good step still runs where the sequence ends
    assert runner.seq_lens[0] == 4


def test_invalid_step_is_a_stagemesh_error():
    assert issubclass(InvalidStep, StagemeshError)
