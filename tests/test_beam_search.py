"""Beam search (use_beam_search) as vLLM runs it, above the engine: the algorithm on a scripted model (EOS, length
penalty, early stopping), its best beam against transformers' generate(num_beams=4) on the stages' own logits
(one stage and PP=2, in-process), and through the router over a PP=2 mesh with the openai client."""
from __future__ import annotations

import asyncio
import itertools
import math

import pytest
import torch

from mesh import Mesh, Router
from parity import prompts
from router.beam_search import Beam, BeamParams, beam_score, search
from stagemesh.core.model_config import layer_ranges
from stagemesh.core.sampling_params import SamplingParams
from stagemesh.core.step import NewSequence, ScheduledChunk, StepBatch
from stage_worker.runner import StageRunner
from tiny_models import TINY, make_tiny_model, reference_model, with_word_tokenizer

WIDTH, NEW_TOKENS = 4, 6


def scripted(table: dict[tuple[int, ...], list[tuple[int, float]]]):
    """A step function over a scripted model: each generated suffix's next-token candidates (log-probabilities)."""
    async def step(prefixes):
        return [table.get(tuple(p[1:]), [(9, math.log(0.5)), (8, math.log(0.5))]) for p in prefixes]
    return step


def test_eos_completes_a_beam_and_the_length_penalty_ranks_as_vllms():
    """A beam that meets EOS is complete (EOS not in its tokens unless include_stop_str_in_output); the answer's
    beams are ranked by cumulative logprob / length ** length_penalty, the prompt counted (vLLM's score)."""
    eos = 2
    table = {(): [(eos, math.log(0.4)), (5, math.log(0.35)), (6, math.log(0.25))],
             (5,): [(7, math.log(0.9)), (eos, math.log(0.1))], (6,): [(7, math.log(0.9)), (eos, math.log(0.1))]}
    by_length = asyncio.run(search([1], BeamParams(2, 2, (eos,)), scripted(table)))
    # length_penalty 1: log(0.315) / 3 (prompt + 2 tokens) beats log(0.4) / 1 for the beam that ended at once
    assert [b.output_token_ids for b in by_length] == [[5, 7], [6, 7]]
    assert [b.finish_reason for b in by_length] == ["length", "length"]
    by_sum = asyncio.run(search([1], BeamParams(2, 2, (eos,), length_penalty=0.0), scripted(table)))
    assert by_sum[0].output_token_ids == [] and by_sum[0].finish_reason == "stop" and by_sum[0].stop_reason == eos
    assert by_sum[1].output_token_ids == [5, 7]
    kept = asyncio.run(search([1], BeamParams(2, 2, (eos,), length_penalty=0.0, include_stop_str_in_output=True),
                              scripted(table)))
    assert kept[0].output_token_ids == [eos]
    assert beam_score(Beam([1, 5, eos], 1, -1.0), (eos,), 1.0) == -0.5  # (an EOS at the end is not counted)


def test_early_stopping_ends_once_width_beams_are_complete():
    eos = 2
    table = {(): [(eos, -0.1), (eos + 1, -0.2), (5, -3.0)], (3,): [(eos, -0.1), (4, -0.5)]}
    calls = []

    async def counting(prefixes):
        calls.append(len(prefixes))
        return await scripted(table)(prefixes)

    beams = asyncio.run(search([1], BeamParams(2, 5, (eos,), early_stopping=True), counting))
    assert len(calls) == 2 and all(b.finish_reason == "stop" for b in beams)  # two complete after the 2nd step
    calls.clear()
    asyncio.run(search([1], BeamParams(2, 5, (eos,)), counting))
    assert len(calls) == 5  # vLLM's default runs to max_tokens while beams run


def stage_steps(model_dir, split):
    """A step function over stage slices: each prefix computed alone (its KV in blocks reused each time), the
    top 2 x WIDTH of the log-softmax of its last position's logits."""
    runners = [StageRunner.of(model_dir, a, b) for a, b in layer_ranges(split)]
    for r in runners:
        r.allocate_kv_cache(8)
    ids = itertools.count()

    async def step(prefixes):
        out = []
        for prefix in prefixes:
            seq = next(ids)
            batch = StepBatch(seq, [NewSequence(seq, prefix, SamplingParams(max_tokens=1))],
                              [ScheduledChunk(seq, prefix, 0, list(range(-(-len(prefix) // 16))), True)],
                              finished_seq_ids=[seq - 1] if seq else [])
            hidden = None
            for r in runners:
                result = r.execute(batch, hidden, return_logits=True)
                hidden = result.hidden_states
            top = torch.topk(torch.log_softmax(result.logits[0], -1), 2 * WIDTH)
            out.append(list(zip(top.indices.tolist(), top.values.tolist())))
        return out
    return step


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("beam")
    return with_word_tokenizer(make_tiny_model(root / "raw", "llama"), root / "model")


@torch.inference_mode()
def hf_best_beam(model, prompt: list[int]) -> list[int]:
    out = model.generate(torch.tensor([prompt]), num_beams=WIDTH, do_sample=False, max_new_tokens=NEW_TOKENS,
                         eos_token_id=None, pad_token_id=0, length_penalty=1.0, early_stopping=False)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("split", [[4], [2, 2]])
def test_best_beam_equals_transformers_on_the_stages_logits(model_dir, split):
    model = reference_model(model_dir)
    step = stage_steps(model_dir, split)
    params = BeamParams(WIDTH, NEW_TOKENS, ignore_eos=True)
    for prompt in prompts(TINY["vocab_size"], lengths=(5, 9, 12, 3), seed=3):
        [best, *_] = asyncio.run(search(prompt, params, step))
        assert best.output_token_ids == hf_best_beam(model, prompt)


@pytest.mark.slow
def test_beam_search_through_the_router_equals_transformers(model_dir, tmp_path):
    """4 of 4 prompts through a PP=2 mesh with the openai client: completions' best beam (choice 0) is
    transformers' best beam; chat answers n beams, best first; a field beam search does not use is a 400."""
    import openai

    model = reference_model(model_dir)
    ps = prompts(TINY["vocab_size"], lengths=(5, 9, 12, 3), seed=3)
    with Mesh(model_dir, [2, 2], log_dir=tmp_path) as mesh, Router(model_dir, [mesh.address], log_dir=tmp_path) as r:
        client, name = r.client(), str(model_dir)
        for prompt in ps:
            out = client.completions.create(model=name, prompt=prompt, max_tokens=NEW_TOKENS, n=WIDTH,
                                            extra_body={"use_beam_search": True, "ignore_eos": True,
                                                        "return_token_ids": True})
            assert len(out.choices) == WIDTH
            assert out.choices[0].token_ids == hf_best_beam(model, prompt)
            assert out.usage.completion_tokens == WIDTH * NEW_TOKENS
        chat = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "w5 w6 w7"}], n=2,
                                              max_tokens=4, extra_body={"use_beam_search": True,
                                                                        "length_penalty": 0.5})
        assert [c.index for c in chat.choices] == [0, 1] and all(c.message.content for c in chat.choices)
        with pytest.raises(openai.BadRequestError, match="'top_p' does not apply to beam search"):
            client.completions.create(model=name, prompt="w5", max_tokens=2, top_p=0.5,
                                      extra_body={"use_beam_search": True})
        with pytest.raises(openai.BadRequestError, match="only applies to beam search"):
            client.completions.create(model=name, prompt="w5", max_tokens=2, extra_body={"length_penalty": 2.0})
