"""Speculative decoding without processes: the config, prompt lookup, the scheduler's drafts and roll-back,
the last stage's verification, and the in-process engine against transformers (greedy) and against the
model's own distribution (sampled)."""
from __future__ import annotations

import json

import pytest
import torch

from parity import prompts
from scheduler.config import SchedulerConfig
from scheduler.driver import DriverConfig
from scheduler.ngram import NgramProposer
from scheduler.pipeline import StepResult, check_result
from scheduler.scheduler import Scheduler
from stagemesh.core.engine_request import EngineRequest
from stagemesh.core.errors import StagemeshError
from stagemesh.core.sampling_params import SamplingParams
from stagemesh.core.speculative import parse_speculative_config
from stagemesh.core.step import NewSequence, SampledToken
from stage_worker.sampler import Sampler
from tiny_models import reference_model, reference_tokens, with_word_tokenizer

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


# -- the config ---------------------------------------------------------------------------------------------
def test_ngram_config_takes_vllms_keys_and_defaults():
    c = parse_speculative_config(json.dumps(NGRAM))
    assert (c.method, c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max) == ("ngram", 3, 1, 3)
    assert parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 2}').prompt_lookup_min == 5
    assert parse_speculative_config('{"model": "[ngram]", "num_speculative_tokens": 2, '
                                    '"prompt_lookup_max": 4}').prompt_lookup_min == 4
    assert parse_speculative_config(c.to_json()) == c


@pytest.mark.parametrize("config, named", [
    ({"method": "eagle", "model": "x", "num_speculative_tokens": 3}, "'eagle' is not supported"),
    ({"method": "ernie_mtp", "num_speculative_tokens": 1}, "'ernie_mtp' is not supported"),
    ({"method": "suffix", "num_speculative_tokens": 3}, "'suffix' is not supported"),
    ({"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": 4}, "'disable_by_batch_size'"),
    ({"method": "ngram"}, "needs num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be an integer >= 1"),
    ({"method": "ngram", "num_speculative_tokens": 99}, "at most 32"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_min=4 must be <= prompt_lookup_max=2"),
    ({"method": "ngram", "num_speculative_tokens": 2, "rejection_sample_method": "synthetic"}, "'synthetic'"),
    ({"model": "/nonexistent", "num_speculative_tokens": 2}, "is not a model directory"),
])
def test_what_is_not_built_is_refused_by_name(config, named):
    with pytest.raises(StagemeshError, match=named):
        parse_speculative_config(json.dumps(config))


def test_async_scheduling_is_refused_with_speculation():
    spec = parse_speculative_config(json.dumps(NGRAM))
    with pytest.raises(StagemeshError, match="--async-scheduling with --speculative-config"):
        DriverConfig(SchedulerConfig(speculative=spec), async_scheduling=True)
    DriverConfig(SchedulerConfig(speculative=spec))  # the default (on only with GPUs) is turned off


# -- prompt lookup --------------------------------------------------------------------------------------------
def test_prompt_lookup_finds_the_longest_suffix_at_its_earliest_place():
    ngram = NgramProposer(2, 3)
    assert ngram.propose([1, 2, 3, 4, 2, 3], 4) == [4, 2, 3]  # vLLM's example: [2, 3] matches, 3 tokens follow
    # [7, 8, 9] occurs twice: the earliest wins; the longer match beats the later shorter one
    assert ngram.propose([7, 8, 9, 1, 5, 8, 9, 2, 7, 8, 9], 2) == [1, 5]
    assert ngram.propose([1, 2, 3, 4], 3) == []  # no suffix of 2+ tokens occurs before
    assert ngram.propose([5, 5], 3) == []  # the suffix itself is no match
    assert NgramProposer(1, 1).propose([5, 5], 3) == [5]
    # a token id whose bytes straddle two others' is not a match (4-byte words)
    assert ngram.propose([0x01000000, 0x00000002, 1, 2, 1, 2], 1) == [1]


# -- the scheduler -------------------------------------------------------------------------------------------
def spec_scheduler(**kw) -> Scheduler:
    kw.setdefault("max_model_len", 256)
    return Scheduler(SchedulerConfig(num_kv_blocks=64, block_size=4, eos_token_ids=(2,),
                                     speculative=parse_speculative_config(json.dumps(NGRAM)), **kw))


def step(s: Scheduler, results: dict[str, list[int]]):
    """Schedule a step and answer it: request id -> the tokens its chunk returns (at most one more than the
    drafts it carries, as a stage can)."""
    out = s.schedule()
    c = out.step_batch.chunks
    sampled = [SampledToken(seq, t) for r, seq, sample, d in zip(out.request_ids, c.seq_ids, c.sample,
                                                                c.draft_counts()) if sample
               for t in results[r][:d + 1]]
    check_result(out.step_batch, StepResult(sampled), 384)
    return out, {o.request_id: o for o in s.update_from_output(out, sampled)}


def test_a_decode_step_carries_the_drafts_and_rolls_back_over_the_rejected():
    s = spec_scheduler()
    s.add_request(EngineRequest("a", [5, 6, 7, 5, 6], SamplingParams(max_tokens=20, ignore_eos=True)))
    out, _ = step(s, {"a": [7]})  # prompt, then 7: "5 6 7" occurred before -> drafts 5 6 7
    assert s.requests["a"].spec_token_ids == [5, 6, 7]
    out, res = step(s, {"a": [5, 6, 9]})  # the first two drafts accepted, 9 instead of the third
    chunk = out.step_batch.chunks[0]
    assert (chunk.token_ids, chunk.start_position, chunk.num_draft_tokens) == ([7, 5, 6, 7], 5, 3)
    assert res["a"].new_token_ids == [5, 6, 9]
    a = s.requests["a"]
    assert a.num_computed_tokens == 8 and a.num_tokens == 9  # positions 5-7 kept, the rejected 8th not
    out, _ = step(s, {"a": [1]})  # no match for ... 9: a plain decode from position 8
    assert (out.step_batch.chunks[0].token_ids, out.step_batch.chunks[0].start_position) == ([9], 8)
    stats = s.stats().spec_decode
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (1, 3, 2)
    assert stats.accepted_per_pos == [1, 1, 0]


@pytest.mark.parametrize("prompt, sampling, tokens, reason", [
    ([5, 6, 3, 4, 5, 6], SamplingParams(max_tokens=20, stop_token_ids=(4,)), [4], "stop"),
    ([5, 6, 3, 2, 5, 6], SamplingParams(max_tokens=20), [2], "stop"),  # EOS
    ([5, 6, 3, 4, 5, 6], SamplingParams(max_tokens=20, stop_token_ids=(4,), min_tokens=3), [4, 5, 6, 9], None),
    ([5, 6, 3, 4, 5, 6], SamplingParams(max_tokens=4, ignore_eos=True), [4, 5, 6], "length"),
])
def test_the_stop_conditions_apply_token_by_token(prompt, sampling, tokens, reason):
    """The drafts (4 5 6, or 2 5 6) all accepted, then 9: a stop inside the run ends the request there."""
    s = spec_scheduler()
    s.add_request(EngineRequest("a", prompt, sampling))
    step(s, {"a": [3]})
    assert s.requests["a"].spec_token_ids[1:] == [5, 6]
    _, res = step(s, {"a": [prompt[3], 5, 6, 9]})
    assert res["a"].new_token_ids == tokens and res["a"].finish_reason == reason


def test_drafts_stop_at_max_tokens():
    s = spec_scheduler()
    s.add_request(EngineRequest("a", [5, 6, 7, 5, 6], SamplingParams(max_tokens=3, ignore_eos=True)))
    step(s, {"a": [7]})
    out, res = step(s, {"a": [5, 6]})  # 2 more tokens to go: one draft, and the token after it
    assert out.step_batch.chunks[0].num_draft_tokens == 1
    assert res["a"].finish_reason == "length" and s.stats().spec_decode.num_draft_tokens == 1


def test_only_accepted_tokens_fill_cached_blocks():
    s = spec_scheduler()
    s.add_request(EngineRequest("a", [5, 6, 7, 5, 6], SamplingParams(max_tokens=20, ignore_eos=True)))
    step(s, {"a": [7]})
    step(s, {"a": [9]})  # every draft rejected: positions 0-5 computed, block 1 (4-7) not full
    assert s.kv.find_cached_prefix([5, 6, 7, 5, 6, 7, 5, 6, 1]) == [s.kv.tables["a"][0]]


def test_the_stage_must_answer_drafts_with_tokens_that_follow_them():
    s = spec_scheduler()
    s.add_request(EngineRequest("a", [5, 6, 7, 5, 6], SamplingParams(max_tokens=20, ignore_eos=True)))
    step(s, {"a": [7]})
    out = s.schedule()
    seq = out.step_batch.chunks.seq_ids[0]
    for tokens in ([5, 9, 6], [5, 6, 7, 8, 1]):  # an accepted token that is no draft; more than k + 1
        with pytest.raises(StagemeshError, match="do not follow its drafts"):
            check_result(out.step_batch, StepResult([SampledToken(seq, t) for t in tokens]), 384)


# -- verification on the last stage -------------------------------------------------------------------------
def rows(*tokens: int, vocab: int = 8, peak: float = 5.0) -> torch.Tensor:
    """Logits whose argmax is each token in turn."""
    logits = torch.zeros(len(tokens), vocab)
    logits[range(len(tokens)), list(tokens)] = peak
    return logits


def test_greedy_verification_accepts_while_the_argmax_agrees():
    s = Sampler()
    for i in range(3):
        s.add_sequence(NewSequence(i, [0], SamplingParams(logprobs=0)))
    logits = torch.cat([rows(3, 4, 5), rows(1), rows(6, 6)])
    out = s.sample(logits, [0, 1, 2], [[3, 4], [], [7]])
    assert [(t.seq_id, t.token_id) for t in out] == [(0, 3), (0, 4), (0, 5), (1, 1), (2, 6)]
    assert all(t.logprob is not None and t.logprob < 0 for t in out)
    assert s.seqs[0].output == [3, 4, 5] and s.seqs[2].output == [6]


def test_penalties_see_the_drafts_before_each_row():
    # a repetition penalty on 3: after the draft 3 is accepted, row 1 must not pick 3 again
    s = Sampler()
    s.add_sequence(NewSequence(0, [0], SamplingParams(repetition_penalty=2.0)))
    logits = torch.tensor([[0, 0, 0, 4.0, 3.0, 0, 0, 0], [0, 0, 0, 4.0, 3.0, 0, 0, 0]])
    assert [t.token_id for t in s.sample(logits, [0], [[3]])] == [3, 4]


def test_seeded_sampling_draws_the_same_tokens_with_and_without_drafts():
    torch.manual_seed(0)
    logits = torch.randn(6, 8)
    p = SamplingParams(temperature=1.0, seed=42, presence_penalty=0.5)
    plain = Sampler()
    plain.add_sequence(NewSequence(0, [0], p))
    want = [plain.sample(logits[i:i + 1], [0])[0].token_id for i in range(6)]
    spec = Sampler()
    spec.add_sequence(NewSequence(0, [0], p))
    got = [t.token_id for t in spec.sample(logits[:3], [0], [want[:2]])]  # right drafts: all accepted
    assert got == want[:3]
    wrong = (want[3] + 1) % 8
    got += [t.token_id for t in spec.sample(logits[3:6], [0], [[wrong, want[4]]])]  # rejected at once
    assert got == want[:4]


def test_a_constrained_sequence_verifies_drafts_through_its_grammar(tiny_model_dir, tmp_path):
    """The matcher masks each draft's row as if the drafts before it were taken, then comes back: a draft the
    grammar rules out is rejected at its row, and the tokens emitted advance the matcher once."""
    from stagemesh.core.grammar import lazy_compiler
    from stagemesh.core.sampling_params import StructuredOutputs

    model_dir = with_word_tokenizer(tiny_model_dir("llama"), tmp_path / "model")
    s = Sampler(grammars=lazy_compiler(model_dir, 384, [2]))
    s.add_sequence(NewSequence(0, [3], SamplingParams(structured=StructuredOutputs("regex", "(w5|w6)(w[0-9]+){2}"))))
    first = rows(9, 3, vocab=384)
    first[0, 6] = 4.0  # 9 leads but cannot start the output: 6, the best allowed, is taken instead
    assert [t.token_id for t in s.sample(first, [0], [[9, 3]])] == [6]
    # 12 and 13 accepted, then the grammar is complete: EOS (2) after them, whatever the logits prefer
    out = s.sample(rows(12, 13, 40, vocab=384), [0], [[12, 13]])
    assert [t.token_id for t in out] == [12, 13, 2] and all(t.error is None for t in out)
    assert s.seqs[0].matcher.terminated and s.seqs[0].output == [6, 12, 13, 2]


# -- the in-process engine ------------------------------------------------------------------------------------
LENGTHS = (5, 40, 17, 70, 3, 33)


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    model_dir = tiny_model_dir("llama")
    batch = prompts(384, LENGTHS) + [[5, 6, 7, 8, 9] * 8, [10, 11, 12] * 10]
    ref = reference_model(model_dir)
    return model_dir, batch, [reference_tokens(ref, p, 24) for p in batch]


@pytest.mark.parametrize("layout", [dict(), dict(layer_split=[1, 3]), dict(max_num_batched_tokens=20, num_kv_blocks=12),
                                    dict(enable_prefix_caching=False)])
def test_greedy_tokens_equal_transformers_in_process(tiny, layout):
    from stagemesh.entry.local_engine import LocalEngine

    model_dir, batch, want = tiny
    with LocalEngine.of(model_dir, speculative_config=NGRAM, **layout) as engine:
        got = engine.generate(batch + batch[:2], SamplingParams(max_tokens=24, ignore_eos=True))  # 2 hit the cache
        stats = engine.stats()
    assert got == want + want[:2]
    assert stats.spec_decode.num_accepted_tokens > 0
    if "num_kv_blocks" in layout:
        assert stats.num_preemptions > 0


def test_seeded_requests_keep_their_tokens_and_logprobs(tiny):
    """Sampling with seeds, penalties, min_tokens, stop tokens and logprobs: the same tokens as without
    speculation (verification draws each position's token from (seed, position)), logprobs within fp32
    tolerance (a draft's row is computed in a chunk, not alone)."""
    from stagemesh.entry.local_engine import LocalEngine

    model_dir, batch, want = tiny
    penalties = dict(repetition_penalty=1.2, frequency_penalty=0.3)
    samplings = [SamplingParams(max_tokens=24, temperature=0.1, seed=i, min_tokens=4, stop_token_ids=(want[i][10],),
                                logprobs=2, **(penalties if i % 2 else {})) for i in range(len(batch))]
    results = {}
    for spec in (None, NGRAM):
        with LocalEngine.of(model_dir, speculative_config=spec) as engine:
            streams = [list(engine.stream(p, s)) for p, s in zip(batch, samplings)]
            results[spec is None] = [([t for o in outs for t in o.new_token_ids],
                                      [lp.logprob for o in outs for lp in o.new_logprobs],
                                      outs[-1].finish_reason) for outs in streams]
            accepted = engine.stats().spec_decode.num_accepted_tokens if spec else None
    assert [(t, r) for t, _, r in results[False]] == [(t, r) for t, _, r in results[True]]
    for (tokens, spec_lps, _), (_, plain_lps, _) in zip(results[False], results[True]):
        assert len(spec_lps) == len(tokens) and spec_lps == pytest.approx(plain_lps, abs=1e-3)
    assert accepted > 0


def test_sampled_tokens_keep_the_models_distribution(tiny):
    """Statistical: the first three of four tokens at temperature 0.5 and top-k 3 after a prompt where the
    model loops, from 1,500 unseeded requests with prompt lookup (t2 and t3 verified as drafts), against the
    exact probabilities transformers gives: total variation within 0.1 (0.04 measured; a verifier that
    accepted every draft measured 0.57)."""
    from stagemesh.entry.local_engine import LocalEngine

    model_dir, batch, want = tiny
    prompt = batch[6] + want[6]  # ... 76 250 153 76: the greedy loop of a repetitive prompt
    sampling = SamplingParams(max_tokens=4, temperature=0.5, top_k=3, ignore_eos=True)
    exact = exact_distribution(reference_model(model_dir), prompt, 3, top_k=3, temperature=0.5)
    n = 1500
    with LocalEngine.of(model_dir, speculative_config=NGRAM) as engine:
        got = engine.generate([prompt] * n, sampling)
        stats = engine.stats().spec_decode
    counts: dict[tuple, int] = {}
    for tokens in got:
        counts[tuple(tokens[:3])] = counts.get(tuple(tokens[:3]), 0) + 1
    tv = 0.5 * sum(abs(counts.get(k, 0) / n - exact.get(k, 0.0)) for k in set(counts) | set(exact))
    assert stats.num_accepted_tokens > n // 4 and stats.accepted_per_pos[1] > 0, stats
    assert tv < 0.1, (tv, sorted(counts.items(), key=lambda kv: -kv[1])[:6])


@torch.inference_mode()
def exact_distribution(model, prompt: list[int], length: int, top_k: int, temperature: float) -> dict[tuple, float]:
    """P(t1..tn) under temperature and top-k, by enumeration."""
    out: dict[tuple, float] = {(): 1.0}
    for _ in range(length):
        nxt = {}
        for prefix, p in out.items():
            logits = model(torch.tensor([prompt + list(prefix)])).logits[0, -1]
            top = torch.topk(logits, top_k)
            probs = torch.softmax(top.values / temperature, -1)
            for t, q in zip(top.indices.tolist(), probs.tolist()):
                nxt[prefix + (t,)] = p * q
        out = nxt
    return out


# -- a draft model ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("draft, layout", [("self", dict(layer_split=[1, 3])), ("first-2-layers", dict()),
                                           ("first-2-layers", dict(max_num_batched_tokens=20, num_kv_blocks=14))])
def test_a_draft_models_greedy_tokens_equal_transformers(tiny, tmp_path, draft, layout):
    """The target as its own draft: every draft accepted; its first two layers: some; the tokens are
    transformers' either way (through PP, chunked prefill, preemption and prefix-cache hits)."""
    from stagemesh.entry.local_engine import LocalEngine
    from tiny_models import first_layers

    model_dir, batch, want = tiny
    draft_dir = model_dir if draft == "self" else first_layers(model_dir, tmp_path / "draft", 2)
    spec = {"model": str(draft_dir), "num_speculative_tokens": 3}
    with LocalEngine.of(model_dir, speculative_config=spec, **layout) as engine:
        got = engine.generate(batch + batch[:2], SamplingParams(max_tokens=24, ignore_eos=True))
        stats = engine.stats()
    assert got == want + want[:2]
    s = stats.spec_decode
    if draft == "self":
        assert s.num_accepted_tokens == s.num_draft_tokens > 0
    else:
        assert 0 < s.num_accepted_tokens < s.num_draft_tokens
    assert ("num_kv_blocks" in layout) == (stats.num_preemptions > 0)


def test_a_draft_model_keeps_seeded_tokens(tiny):
    from stagemesh.entry.local_engine import LocalEngine

    model_dir, batch, _ = tiny
    sampling = SamplingParams(max_tokens=16, temperature=0.1, seed=3, logprobs=1)
    results = []
    for spec in (None, {"model": str(model_dir), "num_speculative_tokens": 2}):
        with LocalEngine.of(model_dir, speculative_config=spec) as engine:
            results.append(engine.generate(batch, sampling))
    assert results[0] == results[1]


def test_a_draft_must_share_the_vocabulary_and_run_on_the_last_stage(tiny_model_dir, tiny, tmp_path):
    import argparse

    from scheduler.rendezvous import ModelIdentity, Rendezvous, StageInfo
    from stage_worker.cli import stage_speculation
    from stage_worker.draft import DraftModel
    from stagemesh.core.model_config import ModelConfig

    model_dir, _, _ = tiny
    other = tiny_model_dir("llama", vocab_size=512)
    cfg = ModelConfig.from_path(model_dir)
    with pytest.raises(StagemeshError, match="vocabulary of 512 tokens; the target's has 384"):
        DraftModel(parse_speculative_config({"model": str(other), "num_speculative_tokens": 2}), cfg, "cpu", None, 16)
    args = argparse.Namespace(speculative_config=json.dumps({"model": str(model_dir), "num_speculative_tokens": 2}))
    with pytest.raises(StagemeshError, match="goes to the last stage only"):
        stage_speculation(args, cfg, 2)
    with pytest.raises(StagemeshError, match="method ngram is the scheduler's"):
        stage_speculation(argparse.Namespace(speculative_config=json.dumps(NGRAM)), cfg, 4)
    identity = ModelIdentity("llama", 4, 64, 384, 4, 2)
    last = StageInfo(1, 2, 4, 1, "cpu", 10, 16, identity, "a:1", "grpc")
    with pytest.raises(StagemeshError, match="the last stage must run"):
        Rendezvous(2, 16, identity, num_speculative_tokens=3).check(last)
    with pytest.raises(StagemeshError, match="runs a draft model .3 tokens per step., which this scheduler does not"):
        Rendezvous(2, 16, identity).check(StageInfo(1, 2, 4, 1, "cpu", 10, 16, identity, "a:1", "grpc", "", False, 3))


def test_serve_gives_the_config_to_the_schedulers_and_a_draft_model_to_the_last_stages(tiny):
    import argparse

    from stagemesh.entry.serve import add_arguments, plan_commands

    model_dir, _, _ = tiny
    p = argparse.ArgumentParser()
    add_arguments(p)
    draft = json.dumps({"model": str(model_dir), "num_speculative_tokens": 2})
    for spec, stages in ((json.dumps(NGRAM), set()), (draft, {"stage[0.1]", "stage[1.1]"})):
        children = {c.name: c.argv for c in plan_commands(p.parse_args(["-dp", "2", "-pp", "2",
                                                                         "--speculative-config", spec]), "/m", 4,
                                                          cuda=False)}
        given = {name: json.loads(argv[argv.index("--speculative-config") + 1])
                 for name, argv in children.items() if "--speculative-config" in argv}
        assert set(given) == {"scheduler[0]", "scheduler[1]"} | stages
        assert all(parse_speculative_config(c) == parse_speculative_config(spec) for c in given.values())
    with pytest.raises(StagemeshError, match="--async-scheduling with --speculative-config"):
        plan_commands(p.parse_args(["--speculative-config", draft, "--async-scheduling"]), "/m", 4, cuda=False)


def test_rejection_sampling_gives_the_targets_distribution():
    """Drafts drawn from q, kept or replaced against p: the tokens follow p (total variation within 0.02 over
    40,000 draws, noise about 0.005) and min(p, q) of them are kept."""
    from stage_worker.rejection import rejection_sample

    gen = torch.Generator().manual_seed(0)
    p = torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0])
    q = torch.tensor([0.1, 0.2, 0.3, 0.2, 0.2])
    n, counts, kept = 40_000, torch.zeros(5), 0
    for d in torch.multinomial(q, n, replacement=True, generator=gen).tolist():
        token = rejection_sample(p, q, d, gen)
        counts[token] += 1
        kept += token == d and float(torch.rand(())) >= 0  # (a replaced draft can come back as itself)
    assert 0.5 * float((counts / n - p).abs().sum()) < 0.02
    assert counts[4] == 0  # what the target rules out never comes out
    assert abs(kept / n - float(torch.minimum(p, q).sum())) < 0.05 + float((p * q).sum())


def test_probabilistic_drafts_keep_the_models_distribution(tiny, tmp_path):
    """The statistical test above with a draft model that samples its drafts (its first two layers: a
    distribution unlike the target's), verified by rejection sampling; greedy and seeded requests beside
    them keep their tokens."""
    from stagemesh.entry.local_engine import LocalEngine
    from tiny_models import first_layers

    model_dir, batch, want = tiny
    prompt = batch[6] + want[6]
    spec = {"model": str(first_layers(model_dir, tmp_path / "draft", 2)), "num_speculative_tokens": 3,
            "draft_sample_method": "probabilistic"}
    exact = exact_distribution(reference_model(model_dir), prompt, 3, top_k=3, temperature=0.5)
    n = 1500
    seeded = SamplingParams(max_tokens=16, temperature=0.5, seed=7)
    with LocalEngine.of(model_dir) as engine:
        want_seeded = engine.generate(batch[:4], seeded)
    with LocalEngine.of(model_dir, speculative_config=spec) as engine:
        got = engine.generate([prompt] * n, SamplingParams(max_tokens=4, temperature=0.5, top_k=3, ignore_eos=True))
        stats = engine.stats().spec_decode
        assert engine.generate(batch, SamplingParams(max_tokens=24, ignore_eos=True)) == want
        assert engine.generate(batch[:4], seeded) == want_seeded
    counts: dict[tuple, int] = {}
    for tokens in got:
        counts[tuple(tokens[:3])] = counts.get(tuple(tokens[:3]), 0) + 1
    tv = 0.5 * sum(abs(counts.get(k, 0) / n - exact.get(k, 0.0)) for k in set(counts) | set(exact))
    assert stats.num_accepted_tokens > n // 4 and stats.accepted_per_pos[1] > 0, stats
    assert tv < 0.1, (tv, sorted(counts.items(), key=lambda kv: -kv[1])[:6])


@pytest.mark.slow
def test_the_default_model_as_its_own_draft_is_accepted_and_answers_as_transformers(default_model_dir):
    from transformers import AutoTokenizer

    from stagemesh.entry.local_engine import LocalEngine

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    texts = ["The capital of France is", "def fibonacci(n):\n    "]
    ids = [tokenizer(t)["input_ids"] for t in texts]
    ref = reference_model(default_model_dir)
    with torch.inference_mode():
        want = [ref.generate(torch.tensor([p]), max_new_tokens=24, min_new_tokens=24, do_sample=False,
                             pad_token_id=tokenizer.eos_token_id)[0, len(p):].tolist() for p in ids]
    spec = {"model": str(default_model_dir), "num_speculative_tokens": 4}
    with LocalEngine.of(default_model_dir, speculative_config=spec) as engine:
        got = engine.generate(ids, SamplingParams(max_tokens=24, ignore_eos=True))
        s = engine.stats().spec_decode
    assert got == want
    assert s.num_accepted_tokens >= 0.95 * s.num_draft_tokens > 0
