"""gpt-oss, the family added by its modules (stagemesh/core/families/gpt_oss.py, stage_worker/gpt_oss.py), in its
bf16 dequantized form: token-exact against transformers on a tiny random model in float32 (attention sinks, biases,
sliding and full layers on prompts longer than the window, YaRN rope, the biased top-k router and clamped SwiGLU
experts), in one stage, pipeline slices and at TP=2 x PP=2 over gloo (its experts split by columns or, expert parallel,
whole over the ranks); what it does not implement is refused by
name (its MXFP4 checkpoint: tests/test_gpt_oss_mxfp4.py)."""
from __future__ import annotations

import json

import pytest
import torch

from parity import chained_logits, prompts
from stagemesh.core.errors import StagemeshError
from stagemesh.core.model_config import ModelConfig
from test_tp_parity import run_tp
from tiny_models import TINY, reference_greedy, reference_model, save_random_model

WINDOW = 8
GPT_OSS = dict(TINY, head_dim=16, num_hidden_layers=4, intermediate_size=32, num_local_experts=8, num_experts_per_tok=4,
               sliding_window=WINDOW, attention_bias=True,
               layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
               rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                "truncate": False, "original_max_position_embeddings": 64, "rope_theta": 150000.0})


@pytest.fixture(scope="module")
def gpt_oss_dir(tmp_path_factory):
    from transformers import GptOssConfig

    config = GptOssConfig(**GPT_OSS)
    config.architectures = ["GptOssForCausalLM"]
    return save_random_model(tmp_path_factory.mktemp("gpt-oss"), config)


@pytest.fixture(scope="module")
def reference(gpt_oss_dir):
    return reference_model(gpt_oss_dir)


def test_slices_match_transformers_logits(gpt_oss_dir, reference):
    prompt = prompts(384, lengths=(37,))[0]
    want_tokens, want_logits = reference_greedy(reference, prompt, 8)
    for split in ([4], [1, 2, 1]):
        tokens, logits = chained_logits(gpt_oss_dir, split, prompt, 8, chunk=16)
        assert tokens == want_tokens, split
        torch.testing.assert_close(logits, want_logits, atol=1e-4, rtol=1e-4)


def test_an_fp8_cache_with_calculated_scales_matches_transformers_reading_the_same_values(gpt_oss_dir, reference):
    """--kv-cache-dtype fp8 --calculate-kv-scales through gpt-oss's attention (sinks, sliding and full layers):
    the same greedy tokens and logits as transformers whose keys and values are read back as the fp8 cache holds
    them, with the scales the first forward set; far closer to that than to the model-dtype cache."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    from kv_fp8_cases import fp8_reference

    prompt, found = prompts(384, lengths=(37,))[0], []
    tokens, logits = chained_logits(gpt_oss_dir, [2, 2], prompt, 8, kv_cache_dtype="fp8", calculate_kv_scales=True,
                                    kv_scales_out=found)
    scales = [pair for stage in found for pair in stage]
    assert len(scales) == 4 and all(k != 1.0 and v != 1.0 for k, v in scales)
    want = reference_greedy(fp8_reference(gpt_oss_dir, scales, forward=eager_attention_forward), prompt, 8)
    assert tokens == want[0]
    torch.testing.assert_close(logits, want[1], atol=5e-3, rtol=1e-3)
    plain = reference_greedy(reference, prompt, 8)[1]
    assert (plain - want[1]).abs().max() > 5 * (logits - want[1]).abs().max()


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp2", "tp2-ep2"])
def test_tp2_pp2_over_gloo_matches_transformers(gpt_oss_dir, reference, tmp_path, expert_parallel):
    """Each TP rank its heads and their sinks, and its share of every expert's columns (the down bias once) or,
    expert parallel, its half of the experts whole (each with its down bias)."""
    prompt = prompts(384, lengths=(37,))[0]
    want_tokens, want_logits = reference_greedy(reference, prompt, 12)
    got = run_tp(gpt_oss_dir, 2, "2,2", prompt, 12, tmp_path, expert_parallel)
    assert got["tokens"] == want_tokens
    torch.testing.assert_close(torch.tensor(got["logits"]), want_logits, atol=1e-4, rtol=1e-4)


def test_yarn_is_transformers_rotary_table():
    from transformers import GptOssConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from kernels.reference import build_cos_sin_cache

    config = GptOssConfig(**GPT_OSS)
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    freqs = torch.arange(100).float()[:, None] * inv_freq[None, :]
    want = torch.cat((freqs.cos() * factor, freqs.sin() * factor), -1)
    cfg = ModelConfig.from_dict(config.to_dict())
    assert factor != 1.0
    torch.testing.assert_close(build_cos_sin_cache(16, 100, cfg.rope_theta, cfg.rope_scaling), want, atol=0, rtol=0)


@pytest.mark.parametrize("change,named", [
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}},
     "quantization_config 'fp8'"),
    ({"layer_types": ["chunked_attention"] * 4}, "layer_types ['chunked_attention']"),
])
def test_what_it_does_not_implement_is_refused_by_name(gpt_oss_dir, change, named):
    config = {**json.loads((gpt_oss_dir / "config.json").read_text()), **change}
    with pytest.raises(StagemeshError, match="gpt_oss: ") as err:
        ModelConfig.from_dict(config)
    assert named in str(err.value) and "is not supported" in str(err.value)


def test_expert_parallel_ranks_hold_whole_experts_and_eplb_is_refused_by_name(gpt_oss_dir):
    from stage_worker.runner import StageRunner

    mlp = StageRunner.of(gpt_oss_dir, 0, 4, tp_rank=1, tensor_parallel_size=2, enable_expert_parallel=True,
                         load=False).model.layers[0].mlp
    experts = GPT_OSS["num_local_experts"]
    assert (mlp.first, mlp.local) == (experts // 2, experts // 2)
    assert tuple(mlp.gate_up.shape) == (experts // 2, GPT_OSS["hidden_size"], 2 * GPT_OSS["intermediate_size"])
    with pytest.raises(StagemeshError, match="--enable-eplb is not built for gpt_oss"):
        StageRunner.of(gpt_oss_dir, 0, 4, enable_expert_parallel=True, enable_eplb=True, load=False)


def test_declared_layer_shapes_are_the_checkpoints(gpt_oss_dir):
    """The planner counts its stacked experts, biases and sinks as the checkpoint holds them."""
    from test_families import assert_layer_shapes_match

    assert_layer_shapes_match(gpt_oss_dir)
