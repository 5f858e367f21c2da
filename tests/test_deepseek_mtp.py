"""DeepSeek-V3's MTP layer as speculative decoding (--speculative-config '{"method": "deepseek_mtp", ...}',
stage_worker.mtp): the greedy tokens are transformers' whatever the drafts; on a model whose MTP layer copies the
main path most drafts are accepted (the acceptance the metrics count); a checkpoint without the layer, a family
without one and keys that do not apply are refused by name."""
from __future__ import annotations

import json

import pytest

from parity import prompts
from stagemesh.core.errors import StagemeshError
from stagemesh.core.sampling_params import SamplingParams
from stagemesh.core.speculative import parse_speculative_config
from stagemesh.entry.local_engine import LocalEngine
from tiny_models import make_tiny_model, reference_model, reference_tokens, with_mtp_layer

MTP = {"method": "deepseek_mtp", "num_speculative_tokens": 2}
NEW_TOKENS = 16


def greedy(model_dir, batch):
    ref = reference_model(model_dir)
    return [reference_tokens(ref, p, NEW_TOKENS) for p in batch]


def test_a_copy_of_the_main_path_drafts_tokens_that_are_accepted(tmp_path):
    """One sparse layer, and an MTP layer that copies it: its drafts are nearly the model's own next tokens.
    Chunked prefill (a prompt's chunks before it samples) and a prefix-cache hit on the batch's repeats."""
    base = make_tiny_model(tmp_path / "base", "deepseek_v3", num_hidden_layers=1, first_k_dense_replace=0)
    model_dir = with_mtp_layer(base, tmp_path / "mtp", copy_of=0)
    batch = prompts(384, (5, 40, 17, 33))
    want = greedy(model_dir, batch)
    with LocalEngine.of(model_dir, speculative_config=MTP, max_num_batched_tokens=24) as engine:
        got = engine.generate(batch + batch[:2], SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
        s = engine.stats().spec_decode
    assert got == want + want[:2]
    assert s.num_accepted_tokens > s.num_draft_tokens // 2 and s.accepted_per_pos[1] > 0, s


def test_random_mtp_drafts_leave_the_tokens_transformers(tiny_model_dir, tmp_path):
    """Drafts of a random MTP layer (rarely accepted) through two stages: the target's tokens all the same."""
    model_dir = with_mtp_layer(tiny_model_dir("deepseek_v3"), tmp_path / "mtp")
    batch = prompts(384, (5, 40, 17))
    want = greedy(model_dir, batch)
    spec = {**MTP, "num_speculative_tokens": 3}
    with LocalEngine.of(model_dir, layer_split=[2, 2], speculative_config=spec) as engine:
        assert engine.generate(batch, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)) == want
        assert engine.stats().spec_decode.num_draft_tokens > 0


def test_a_checkpoint_without_the_layer_is_refused_by_name(tiny_model_dir):
    with pytest.raises(StagemeshError, match=r"deepseek_mtp: the checkpoint in .* has no MTP layer "
                                             r"\(num_nextn_predict_layers 1; no tensor model.layers.4.eh_proj"):
        LocalEngine.of(tiny_model_dir("deepseek_v3"), speculative_config=MTP)
    with pytest.raises(StagemeshError, match=r"deepseek_mtp: deepseek_v2 has no multi-token-prediction layer"):
        LocalEngine.of(tiny_model_dir("deepseek_v2"), speculative_config=MTP)


@pytest.mark.parametrize("extra, named", [
    ({"model": "/models/draft"}, "model does not apply to deepseek_mtp"),
    ({"prompt_lookup_max": 3}, "prompt_lookup_max does not apply to deepseek_mtp"),
    ({"draft_sample_method": "probabilistic"}, "'probabilistic' is not built for deepseek_mtp"),
    ({"draft_tensor_parallel_size": 2}, "the MTP layer runs whole on the last stage's TP rank 0"),
])
def test_keys_that_do_not_apply_are_refused(extra, named):
    with pytest.raises(StagemeshError, match=named):
        parse_speculative_config(json.dumps({**MTP, **extra}))
    spec = parse_speculative_config(json.dumps(MTP))
    assert parse_speculative_config(spec.to_json()) == spec and spec.uses_draft_model
