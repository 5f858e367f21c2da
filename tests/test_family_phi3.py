"""Phi-3, the family added by its module alone (stagemesh/core/families/phi3.py): fused qkv_proj and gate_up_proj
read into the same merged linears as Llama's, token-exact against transformers on a tiny random model in slices,
in the in-process engine, and at TP=2 x PP=2 over gloo, from safetensors and from GGUF files; what it does not implement
is refused by name."""
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


@pytest.fixture(scope="module")
def phi3_dir(tmp_path_factory):
    from transformers import Phi3Config

    return save_random_model(tmp_path_factory.mktemp("phi3"), Phi3Config(**TINY))


@pytest.fixture(scope="module")
def reference(phi3_dir):
    return reference_model(phi3_dir)


def test_slices_match_transformers_logits(phi3_dir, reference):
    prompt = prompts(384, lengths=(37,))[0]
    want_tokens, want_logits = reference_greedy(reference, prompt, 8)
    for split in ([4], [1, 2, 1]):
        tokens, logits = chained_logits(phi3_dir, split, prompt, 8, chunk=16)
        assert tokens == want_tokens, split
        torch.testing.assert_close(logits, want_logits, atol=1e-4, rtol=1e-4)


def test_engine_batched_greedy_tokens_match_transformers(phi3_dir, reference):
    batch = prompts(384)
    want = [reference_tokens(reference, p, 24) for p in batch]
    with LocalEngine.of(phi3_dir, layer_split=[1, 3], max_num_batched_tokens=24) as engine:
        assert engine.generate(batch, SamplingParams(max_tokens=24, ignore_eos=True)) == want


def test_tp2_pp2_over_gloo_matches_transformers(phi3_dir, reference, tmp_path):
    """Each TP rank reads its rows of q, k and v (and of gate and up) out of the fused tensors."""
    prompt = prompts(384, lengths=(37,))[0]
    want_tokens, want_logits = reference_greedy(reference, prompt, 16)
    got = run_tp(phi3_dir, 2, "1,3", prompt, 16, tmp_path)
    assert got["tokens"] == want_tokens
    torch.testing.assert_close(torch.tensor(got["logits"]), want_logits, atol=1e-4, rtol=1e-4)


def test_the_fused_cpu_layer_plan_runs_it(phi3_dir):
    from kernels import cpu_ops
    from stage_worker import layer_plan
    from stage_worker.runner import StageRunner

    if cpu_ops.load() is None:
        pytest.skip("the C++ CPU kernels are not built here")
    layer = StageRunner.of(phi3_dir, 0, 1).model.layers[0]
    assert layer_plan.build(layer).cpp is not None


@pytest.mark.parametrize("change,named", [
    ({"rope_scaling": {"type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}}, "'longrope'"),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "'longrope'"),
    ({"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.75}}, "partial_rotary_factor 0.75"),
])
def test_what_it_does_not_implement_is_refused_by_name(phi3_dir, change, named):
    config = {**json.loads((phi3_dir / "config.json").read_text()), **change}
    with pytest.raises(StagemeshError, match=f"phi3: rope scaling {named}|phi3: {named}") as err:
        ModelConfig.from_dict(config)
    assert "is not supported" in str(err.value)


def test_the_sliding_window_caps_the_context(phi3_dir):
    """Within its window sliding attention is full attention: the positions served stop there."""
    config = json.loads((phi3_dir / "config.json").read_text())
    assert ModelConfig.from_dict({**config, "sliding_window": 64}).max_position_embeddings == 64
    assert ModelConfig.from_dict(config).max_position_embeddings == 512


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1"])
def test_a_gguf_file_gives_transformers_greedy_tokens(phi3_dir, tmp_path, qtype):
    """llama.cpp's phi3 layout (attn_qkv, ffn_up holding gate and up), quantised, against transformers on the
    dequantised weights."""
    from gguf_models import dequantised_model_dir, write_gguf

    path = write_gguf(phi3_dir, tmp_path / f"phi3-{qtype}.gguf", qtype, embed_qtype="Q8_0")
    reference = reference_model(dequantised_model_dir(phi3_dir, path, tmp_path / "dequantised"))
    prompt = prompts(384, lengths=(37,))[0]
    want_tokens, want_logits = reference_greedy(reference, prompt, 6)
    tokens, logits = chained_logits(phi3_dir, [1, 3], prompt, 6, quantization="gguf", gguf_file=str(path))
    assert tokens == want_tokens
    torch.testing.assert_close(logits, want_logits, atol=2e-4, rtol=1e-4)
    with LocalEngine.of(phi3_dir, layer_split=[2, 2], quantization="gguf", gguf_file=str(path)) as engine:
        assert engine.generate([prompt], SamplingParams(max_tokens=6, ignore_eos=True)) == [want_tokens]


def test_declared_layer_shapes_are_the_checkpoints(phi3_dir):
    """The planner counts the fused tensors as the checkpoint holds them."""
    from test_families import assert_layer_shapes_match

    assert_layer_shapes_match(phi3_dir)
