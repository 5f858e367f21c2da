"""Gemma 3 (text), the family added by its modules (stagemesh/core/families/gemma3.py, stage_worker/gemma3.py):
token-exact against transformers on a tiny random model in float32, on prompts longer than its sliding window,
in one stage, in pipeline slices, in the in-process engine and at TP=2 over gloo; what it does not implement is
refused by name."""
from __future__ import annotations

import json

import pytest
import torch

from parity import chained_logits, prompts
from stagemesh.core.errors import StagemeshError
from stagemesh.core.model_config import ModelConfig
from stagemesh.core.sampling_params import SamplingParams
from stagemesh.entry.local_engine import LocalEngine
from test_tp_parity import run_tp
from tiny_models import TINY, reference_greedy, reference_model, reference_tokens, save_random_model

WINDOW = 8  # tokens a local layer sees: the prompts below are several windows long
GEMMA = dict(TINY, head_dim=16, num_hidden_layers=4, sliding_window=WINDOW, query_pre_attn_scalar=24,
             final_logit_softcapping=3.0, tie_word_embeddings=True, hidden_activation="gelu_pytorch_tanh",
             layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"],
             rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1_000_000.0},
                              "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}})


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory):
    from transformers import Gemma3TextConfig

    config = Gemma3TextConfig(**GEMMA)
    config.architectures = ["Gemma3ForCausalLM"]
    return save_random_model(tmp_path_factory.mktemp("gemma3"), config)


@pytest.fixture(scope="module")
def reference(gemma_dir):
    return reference_model(gemma_dir)


def test_the_config_reads_the_global_rope_and_keeps_the_whole_context(gemma_dir):
    cfg = ModelConfig.from_path(gemma_dir)
    assert (cfg.rope_theta, cfg.rope_scaling) == (1_000_000.0, {"rope_type": "linear", "factor": 2.0})
    assert cfg.sliding_window == WINDOW and cfg.max_position_embeddings == 512  # (not capped at the window)


def test_slices_match_transformers_logits(gemma_dir, reference):
    prompt = prompts(384, lengths=(37,))[0]
    want_tokens, want_logits = reference_greedy(reference, prompt, 8)
    for split in ([4], [1, 2, 1]):
        tokens, logits = chained_logits(gemma_dir, split, prompt, 8, chunk=16)
        assert tokens == want_tokens, split
        torch.testing.assert_close(logits, want_logits, atol=1e-4, rtol=1e-4)


def test_an_fp8_cache_with_calculated_scales_matches_transformers_reading_the_same_values(gemma_dir, reference):
    """--kv-cache-dtype fp8 --calculate-kv-scales through Gemma's own attention (local and global layers): the
    same greedy tokens as transformers whose keys and values are read back as the fp8 cache holds them, with the
    scales the first forward set, and logits twenty times closer to it than the model-dtype cache's."""
    from kv_fp8_cases import fp8_reference

    prompt, found = prompts(384, lengths=(37,))[0], []
    tokens, logits = chained_logits(gemma_dir, [2, 2], prompt, 8, kv_cache_dtype="fp8", calculate_kv_scales=True,
                                    kv_scales_out=found)
    scales = [pair for stage in found for pair in stage]
    assert len(scales) == 4 and all(k != 1.0 and v != 1.0 for k, v in scales)
    want_tokens, want_logits = reference_greedy(fp8_reference(gemma_dir, scales), prompt, 8)
    assert tokens == want_tokens
    # (this random model's keys put many values near an e4m3 rounding boundary, and its softcapped logits move
    # far with each: fp8 is 4.7 from the model-dtype cache here, the stage 0.14 from the reference)
    plain = reference_greedy(reference, prompt, 8)[1]
    assert (plain - want_logits).abs().max() > 20 * (logits - want_logits).abs().max()


def test_engine_batched_greedy_tokens_match_transformers(gemma_dir, reference):
    """Chunked prefill and decode batches of sequences longer than the window, over two stages."""
    batch = prompts(384, lengths=(5, 40, 17, 23))
    want = [reference_tokens(reference, p, 12) for p in batch]
    with LocalEngine.of(gemma_dir, layer_split=[2, 2], max_num_batched_tokens=24) as engine:
        assert engine.generate(batch, SamplingParams(max_tokens=12, ignore_eos=True)) == want


def test_tp2_pp2_over_gloo_matches_transformers(gemma_dir, reference, tmp_path):
    """Each TP rank its heads (q/k norms replicated), its rows of gate and up; the vocabulary-parallel head tied."""
    prompt = prompts(384, lengths=(37,))[0]
    want_tokens, want_logits = reference_greedy(reference, prompt, 12)
    got = run_tp(gemma_dir, 2, "2,2", prompt, 12, tmp_path)
    assert got["tokens"] == want_tokens
    torch.testing.assert_close(torch.tensor(got["logits"]), want_logits, atol=1e-4, rtol=1e-4)


def test_an_older_config_reads_the_same(gemma_dir, tmp_path):
    """transformers 4's spelling: rope_theta, rope_scaling and rope_local_base_freq, sliding_window_pattern."""
    from stage_worker.gemma3 import local_rope
    from stagemesh.core.families.gemma3 import layer_types

    old = {k: v for k, v in json.loads((gemma_dir / "config.json").read_text()).items()
           if k not in ("rope_parameters", "layer_types")}
    old.update(rope_theta=1_000_000.0, rope_scaling={"rope_type": "linear", "factor": 2.0}, rope_local_base_freq=10000,
               sliding_window_pattern=2)
    cfg = ModelConfig.from_dict(old)
    assert (cfg.rope_theta, cfg.rope_scaling) == (1_000_000.0, {"rope_type": "linear", "factor": 2.0})
    assert local_rope(cfg) == (10000.0, None)
    assert layer_types(old) == ["sliding_attention", "full_attention"] * 2


@pytest.mark.parametrize("change,named", [
    ({"hidden_activation": "gelu"}, "hidden_activation 'gelu'"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({"layer_types": ["chunked_attention"] * 4}, "layer_types ['chunked_attention']"),
    ({"attention_bias": True}, "attention_bias"),
])
def test_what_it_does_not_implement_is_refused_by_name(gemma_dir, change, named):
    config = {**json.loads((gemma_dir / "config.json").read_text()), **change}
    with pytest.raises(StagemeshError, match="gemma3_text: ") as err:
        ModelConfig.from_dict(config)
    assert named in str(err.value) and "is not supported" in str(err.value)


def test_the_multimodal_checkpoint_is_refused_naming_its_vision_tower(gemma_dir):
    text = json.loads((gemma_dir / "config.json").read_text())
    config = {"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"], "text_config": text,
              "vision_config": {"model_type": "siglip_vision_model"}}
    with pytest.raises(StagemeshError, match="Gemma3ForConditionalGeneration: the vision tower"):
        ModelConfig.from_dict(config)


def test_declared_layer_shapes_are_the_checkpoints(gemma_dir):
    """The planner counts its four norms a layer and its q/k norms as the checkpoint holds them."""
    from test_families import assert_layer_shapes_match

    assert_layer_shapes_match(gemma_dir)
