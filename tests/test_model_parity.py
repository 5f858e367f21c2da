"""Stage slices chained in order give transformers' logits and greedy tokens."""
from __future__ import annotations


import pytest
import torch

from stagemesh.local_engine import LocalEngine
from stagemesh.core.sampling_params import SamplingParams
from parity import chained_logits, prompts
from tiny_models import ARCHS, reference_greedy, reference_model

NEW_TOKENS = 32


@pytest.mark.parametrize("arch", ARCHS)
def test_slices_match_transformers_logits(tiny_model_dir, arch):
    model_dir = tiny_model_dir(arch)
    ref = reference_model(model_dir)
    prompt = prompts(384, lengths=(37,))[0]
    want_tokens, want_logits = reference_greedy(ref, prompt, 8)
    for split in ([4], [2, 2], [1, 2, 1]):
        tokens, logits = chained_logits(model_dir, split, prompt, 8, chunk=16)
        assert tokens == want_tokens, split
        torch.testing.assert_close(logits, want_logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch,overrides", [
    ("llama", {}), ("llama3", {}), ("mistral", {}), ("qwen2", {}), ("qwen3", {}),
    ("llama", {"num_key_value_heads": 1}),  # MQA
    ("llama", {"tie_word_embeddings": True}),
])
def test_batched_greedy_tokens_match_transformers(tiny_model_dir, arch, overrides):
    model_dir = tiny_model_dir(arch, **overrides)
    ref = reference_model(model_dir)
    batch = prompts(384)
    want = [reference_greedy(ref, p, NEW_TOKENS)[0] for p in batch]
    # uneven split, prompts chunked (budget 24 tokens per step) and mixed with decodes
    with LocalEngine(model_dir, split=[1, 3], max_num_batched_tokens=24) as engine:
        assert engine.generate(batch, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)) == want


def test_sharded_checkpoint_loads(tmp_path):
    from tiny_models import make_tiny_model

    model_dir = make_tiny_model(tmp_path, "llama", sharded=True)
    assert (model_dir / "model.safetensors.index.json").exists()
    ref = reference_model(model_dir)
    prompt = prompts(384, lengths=(20,))[0]
    tokens, _ = chained_logits(model_dir, [2, 2], prompt, 8)
    assert tokens == reference_greedy(ref, prompt, 8)[0]


@pytest.mark.slow
def test_default_model_matches_transformers(default_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_dir)
    ref = reference_model(default_model_dir)
    texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village"]
    batch = [tok.encode(t) for t in texts]
    want = [reference_greedy(ref, p, NEW_TOKENS)[0] for p in batch]
    with LocalEngine(default_model_dir, split=[10, 12, 8], max_num_batched_tokens=8) as engine:
        assert engine.generate(batch, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)) == want
