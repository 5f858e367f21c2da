"""Sampling options change the distribution the way their definitions say."""
from __future__ import annotations

import pytest
import torch

from stagemesh.core.sampling_params import SamplingParams
from stagemesh.core.step import NewSequence
from stage_worker.logits_processors import process_row
from stage_worker.sampler import Sampler

VOCAB = 8


def sampler_with(*params: SamplingParams, prompts=None, outputs=None) -> Sampler:
    s = Sampler()
    for i, p in enumerate(params):
        s.add_sequence(NewSequence(i, (prompts or {}).get(i, [0]), p, list((outputs or {}).get(i, []))))
    return s


def logits_row(*values: float) -> torch.Tensor:
    return torch.tensor([list(values)], dtype=torch.float32)


def draw(p: SamplingParams, logits: torch.Tensor, n: int = 400) -> set[int]:
    s = sampler_with(p)
    seen = set()
    for _ in range(n):
        seen.add(s.sample(logits, [0])[0].token_id)
    return seen


def test_greedy_takes_the_argmax():
    s = sampler_with(SamplingParams(), SamplingParams())
    out = s.sample(torch.tensor([[0.1, 3.0, 0.2], [5.0, 1.0, 0.0]]), [0, 1])
    assert [t.token_id for t in out] == [1, 0]


def test_top_k_one_is_greedy_and_top_k_limits_support():
    logits = logits_row(1.0, 1.1, 0.9, 1.05)
    assert draw(SamplingParams(temperature=1.0, top_k=1), logits) == {1}
    assert draw(SamplingParams(temperature=1.0, top_k=2), logits) == {1, 3}


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()[None]
    assert draw(SamplingParams(temperature=1.0, top_p=0.75), logits) == {0, 1}
    assert draw(SamplingParams(temperature=1.0, top_p=0.5), logits) == {0}


def test_min_p_drops_tokens_below_fraction_of_the_best():
    logits = torch.tensor([0.4, 0.3, 0.2, 0.1]).log()[None]
    assert draw(SamplingParams(temperature=1.0, min_p=0.6), logits) == {0, 1}


def test_temperature_sampling_covers_the_support():
    assert draw(SamplingParams(temperature=1.0), torch.zeros(1, 4)) == {0, 1, 2, 3}


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    s = sampler_with(SamplingParams(repetition_penalty=2.0), prompts={0: [0, 1]})
    logits = logits_row(2.0, -1.0, 1.5, 0.0)
    row = logits[0].clone()
    process_row(row, s.seqs[0], ())
    assert row.tolist() == [1.0, -2.0, 1.5, 0.0]


def test_presence_and_frequency_penalties_count_generated_tokens_only():
    p = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    s = sampler_with(p, prompts={0: [3]}, outputs={0: [1, 1, 2]})
    row = torch.zeros(4)
    process_row(row, s.seqs[0], ())
    assert row.tolist() == [0.0, -1.0, -0.75, 0.0]


def test_seed_gives_same_tokens_whatever_the_batch():
    p = SamplingParams(temperature=1.0, seed=1234)
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(0))
    alone = sampler_with(p)
    alone_tokens = [alone.sample(logits, [0])[0].token_id for _ in range(10)]
    others = SamplingParams(temperature=1.0)
    crowd = sampler_with(others, p, others)
    batch = torch.cat([torch.randn(1, 50), logits, torch.randn(1, 50)])
    crowd_tokens = [crowd.sample(batch, [0, 1, 2])[1].token_id for _ in range(10)]
    assert alone_tokens == crowd_tokens
    assert len(set(alone_tokens)) > 1  # it is sampling, not argmax


def test_logprobs_of_sampled_and_top_tokens():
    s = sampler_with(SamplingParams(logprobs=2))
    logits = logits_row(1.0, 3.0, 2.0, 0.0)
    tok = s.sample(logits, [0])[0]
    expect = torch.log_softmax(logits[0], -1)
    assert tok.token_id == 1
    assert tok.logprob == pytest.approx(float(expect[1]))
    assert tok.top_token_ids == [1, 2]
    assert tok.top_logprobs == pytest.approx([float(expect[1]), float(expect[2])])


def test_a_row_that_cannot_be_sampled_fails_alone():
    s = sampler_with(SamplingParams(), SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, seed=3))
    logits = torch.tensor([[0.0, 1.0, 0.5], [float("nan"), 1.0, 0.0], [0.2, 0.1, 3.0]])
    out = s.sample(logits, [0, 1, 2])
    assert [t.error is None for t in out] == [True, False, True]
    assert "not finite" in out[1].error
    assert out[0].token_id == 1 and out[2].token_id in (0, 1, 2)
    assert s.seqs[1].output == [0]  # a step run ahead of the failed row can still be filled


def test_a_denormal_temperature_is_greedy_not_nan():
    s = sampler_with(SamplingParams(temperature=1e-45), SamplingParams(temperature=1e-45, top_p=1e-45))
    out = s.sample(torch.tensor([[0.0, 9.0, 3.0], [5.0, 1.0, 0.0]]), [0, 1])
    assert [(t.token_id, t.error) for t in out] == [(1, None), (0, None)]


def test_a_tiny_top_p_keeps_the_most_likely_token():
    assert draw(SamplingParams(temperature=1.0, top_p=1e-45), logits_row(1.0, 3.0, 2.0), n=50) == {1}


def test_logit_bias_forces_and_forbids_tokens_greedy_and_sampled():
    logits = logits_row(1.0, 5.0, 2.0, 0.0)
    assert draw(SamplingParams(logit_bias=((3, 100.0),)), logits, n=5) == {3}
    assert draw(SamplingParams(temperature=1.0, logit_bias=((1, -100.0), (2, -100.0))), logits) == {0, 3}


def test_allowed_token_ids_restrict_the_choice():
    assert draw(SamplingParams(temperature=1.0, allowed_token_ids=(0, 2)), torch.zeros(1, 6)) == {0, 2}
    assert draw(SamplingParams(allowed_token_ids=(2, 3)), logits_row(9.0, 8.0, 1.0, 3.0), n=3) == {3}


def test_bad_words_ban_the_last_token_after_the_rest_of_the_word():
    s = sampler_with(SamplingParams(bad_words_token_ids=((1, 2), (3,))), outputs={0: [0, 1]})
    logits = logits_row(0.0, 0.0, 9.0, 8.0, 7.0)
    assert s.sample(logits, [0])[0].token_id == 4  # 2 follows 1 (banned), 3 is banned everywhere
    assert s.sample(logits, [0])[0].token_id == 2  # the output now ends with 4: 2 may follow


def test_min_tokens_keeps_eos_and_stop_tokens_out_until_reached():
    s = Sampler(eos_token_ids=(2,))
    s.add_sequence(NewSequence(0, [0], SamplingParams(min_tokens=2, max_tokens=4, stop_token_ids=(3,))))
    logits = logits_row(0.0, 1.0, 9.0, 8.0)
    assert [s.sample(logits, [0])[0].token_id for _ in range(3)] == [1, 1, 2]


def test_a_row_with_no_token_left_fails_alone():
    s = sampler_with(SamplingParams(allowed_token_ids=(1,), bad_words_token_ids=((1,),)), SamplingParams())
    out = s.sample(logits_row(0.0, 1.0, 2.0).repeat(2, 1), [0, 1])
    assert "no token can be sampled" in out[0].error and out[1].error is None and out[1].token_id == 2


def test_logprobs_are_of_the_model_not_of_the_processed_logits():
    s = sampler_with(SamplingParams(logprobs=0, logit_bias=((0, 100.0),)))
    logits = logits_row(1.0, 3.0)
    tok = s.sample(logits, [0])[0]
    assert tok.token_id == 0 and tok.logprob == pytest.approx(float(torch.log_softmax(logits[0], -1)[0]))


@pytest.fixture(scope="module")
def word_grammars(tiny_model_dir, tmp_path_factory):
    from stagemesh.core.grammar import lazy_compiler
    from tiny_models import with_word_tokenizer

    model_dir = with_word_tokenizer(tiny_model_dir("llama"), tmp_path_factory.mktemp("sampler-words") / "m")
    return lazy_compiler(model_dir, 384, [2])


def test_a_constraint_masks_its_row_only_and_follows_the_output(word_grammars):
    from stagemesh.core.sampling_params import StructuredOutputs

    s = Sampler(grammars=word_grammars)
    regex = StructuredOutputs("regex", "w7w9")  # two word tokens, then the stop token (2)
    s.add_sequence(NewSequence(0, [5], SamplingParams(structured=regex)))
    s.add_sequence(NewSequence(1, [5], SamplingParams()))
    logits = torch.zeros(2, 384)
    logits[:, 30] = 9.0  # what both would take unconstrained
    assert [t.token_id for t in s.sample(logits, [0, 1])] == [7, 30]
    assert [t.token_id for t in s.sample(logits, [0, 1])] == [9, 30]
    assert [t.token_id for t in s.sample(logits, [0, 1])] == [2, 30]  # the language ends: only EOS
    # a step scheduled ahead of the scheduler seeing that EOS still samples (its token is dropped), no error
    out = s.sample(logits, [0, 1])
    assert out[0].error is None and out[1].token_id == 30
    # preempted and sent again with its output: the matcher resumes after it
    s.remove_sequence(0)
    s.add_sequence(NewSequence(0, [5], SamplingParams(structured=regex), [7]))
    assert s.sample(logits, [0])[0].token_id == 9


def test_a_constraint_that_cannot_be_followed_fails_its_request_alone(word_grammars):
    from stagemesh.core.sampling_params import StructuredOutputs

    s = Sampler(grammars=word_grammars)
    s.add_sequence(NewSequence(0, [5], SamplingParams(structured=StructuredOutputs("regex", "[a-"))))
    s.add_sequence(NewSequence(1, [5], SamplingParams(structured=StructuredOutputs("regex", "w7")), [8]))
    s.add_sequence(NewSequence(2, [5], SamplingParams()))
    out = s.sample(torch.zeros(3, 384), [0, 1, 2])
    assert "does not compile" in out[0].error and "Regex parsing error" in out[0].error
    assert "token 8 of the output so far does not fit the constraint" in out[1].error
    assert out[2].error is None


def test_draw_follows_the_weights_and_never_draws_a_zero():
    """rejection.draw (every random token): frequencies within 5 sigma of the weights over 40k draws, zero
    weights never drawn, weights need not sum to one, a seeded generator repeats itself."""
    from stage_worker.rejection import draw

    weights = torch.tensor([0.0, 3.0, 0.0, 1.0, 0.5, 0.0, 0.25, 0.0])  # sums to 4.75
    gen = torch.Generator().manual_seed(0)
    n = 40_000
    counts = torch.bincount(torch.tensor([draw(weights, gen) for _ in range(n)]), minlength=len(weights))
    p = weights / weights.sum()
    assert counts[p == 0].sum() == 0
    sigma = (n * p * (1 - p)).sqrt()
    assert ((counts - n * p).abs() <= 5 * sigma + 1).all(), (counts, n * p)
    runs = [[draw(weights, torch.Generator().manual_seed(7)) for _ in range(3)] for _ in range(2)]
    assert runs[0] == runs[1]
    assert draw(torch.tensor([0.0, 0.0, 1e-30]), gen) == 2  # a tiny mass is still a mass


@pytest.mark.parametrize("weights", [[0.0, 0.0], [1.0, float("nan")], [float("inf"), 1.0], [0.5, -0.1, 0.6]])
def test_draw_refuses_a_distribution_without_finite_positive_mass(weights):
    from stage_worker.rejection import draw

    with pytest.raises(ValueError, match="no finite positive mass"):
        draw(torch.tensor(weights), torch.Generator().manual_seed(0))
