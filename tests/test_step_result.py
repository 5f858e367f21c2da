"""A last stage's answer to a step is checked before the scheduler takes it in (scheduler.pipeline.check_result):
a step without drafts, the common case, takes a short path that must refuse what the general one refuses."""
from __future__ import annotations

import pytest

from scheduler.config import SchedulerConfig
from scheduler.pipeline import StepResult, check_result
from scheduler.scheduler import Scheduler
from stagemesh.core.engine_request import EngineRequest
from stagemesh.core.errors import StagemeshError
from stagemesh.core.sampling_params import SamplingParams
from stagemesh.core.step import SampledToken

VOCAB = 384


def two_sequences():
    """A step of two requests' prompts (both sample) and of a third's first chunk (does not sample)."""
    s = Scheduler(SchedulerConfig(num_kv_blocks=64, max_model_len=256, block_size=4, eos_token_ids=(2,),
                                  max_num_batched_tokens=6))
    for request_id, prompt in (("a", [3, 4]), ("b", [5, 6]), ("c", [7, 8, 9, 10])):
        s.add_request(EngineRequest(request_id, prompt, SamplingParams(max_tokens=5)))
    out = s.schedule()
    assert out.step_batch.chunks.sample == [True, True, False]
    return out.step_batch, out.step_batch.chunks.seq_ids[:2]


def test_an_answer_with_a_token_for_each_sampling_chunk_in_order_passes():
    batch, (a, b) = two_sequences()
    check_result(batch, StepResult([SampledToken(a, 7), SampledToken(b, VOCAB - 1)]), VOCAB)
    # one row that failed to sample fails its request alone: the answer stands
    check_result(batch, StepResult([SampledToken(a, 7), SampledToken(b, 0, error="not finite")]), VOCAB)


@pytest.mark.parametrize("answer,words", [
    (lambda a, b: [SampledToken(b, 7), SampledToken(a, 7)], "the stage sampled sequences"),  # out of order
    (lambda a, b: [SampledToken(a, 7)], "the stage sampled sequences"),  # one missing
    (lambda a, b: [SampledToken(a, 7), SampledToken(b, 7), SampledToken(b + 1, 7)], "the stage sampled sequences"),
    (lambda a, b: [SampledToken(a, 7), SampledToken(b, 7), SampledToken(b, 8)], "do not follow its drafts"),
    (lambda a, b: [SampledToken(a, 7), SampledToken(b, VOCAB)], "outside the vocabulary of 384"),
    (lambda a, b: [SampledToken(a, -1), SampledToken(b, 7)], "outside the vocabulary of 384"),
    (lambda a, b: [SampledToken(a, 0, error="x"), SampledToken(b, 0, error="y")], "every one of the 2 sequences"),
])
def test_an_answer_that_does_not_fit_the_step_is_refused(answer, words):
    batch, (a, b) = two_sequences()
    with pytest.raises(StagemeshError, match=words):
        check_result(batch, StepResult(answer(a, b)), VOCAB)


def test_drafts_proposed_for_a_step_without_drafts_are_checked():
    batch, (a, b) = two_sequences()
    sampled = [SampledToken(a, 7), SampledToken(b, 7)]
    check_result(batch, StepResult(sampled, drafts={a: [5, 6]}), VOCAB)
    with pytest.raises(StagemeshError, match="proposed drafts for sequence"):
        check_result(batch, StepResult(sampled, drafts={a: [VOCAB]}), VOCAB)
