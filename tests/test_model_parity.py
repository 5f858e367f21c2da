"""Stage slices chained in order give transformers' logits and greedy tokens."""
from __future__ import annotations


import pytest
import torch

from stagemesh.entry.local_engine import LocalEngine
from stagemesh.core.sampling_params import SamplingParams
from parity import chained_logits, prompts
from tiny_models import ARCHS, reference_greedy, reference_model, reference_tokens

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
    want = [reference_tokens(ref, p, NEW_TOKENS) for p in batch]
    # uneven split, prompts chunked (budget 24 tokens per step) and mixed with decodes
    with LocalEngine.of(model_dir, layer_split=[1, 3], max_num_batched_tokens=24) as engine:
        assert engine.generate(batch, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)) == want


def test_forward_hooks_still_run(tiny_model_dir):
    """The layers skip nn.Module's call machinery only while no hook is registered (stage_worker.layers.Module):
    a forward hook, on one layer or global, sees every call, and the tokens do not change."""
    from torch.nn.modules.module import register_module_forward_hook

    from stage_worker.model import DecoderLayer

    model_dir = tiny_model_dir("llama")
    prompt = prompts(384, lengths=(20,))[0]
    with LocalEngine.of(model_dir) as engine:
        want = engine.generate([prompt], SamplingParams(max_tokens=4, ignore_eos=True))
        layer = next(m for m in engine.runners[0].model.modules() if isinstance(m, DecoderLayer))
        seen, every = [], []
        handles = [layer.register_forward_hook(lambda m, args, out: seen.append(out[0].shape)),
                   register_module_forward_hook(lambda m, args, out: every.append(type(m).__name__))]
        try:
            assert engine.generate([prompt], SamplingParams(max_tokens=4, ignore_eos=True)) == want
        finally:
            for h in handles:
                h.remove()
    # the prompt past its cached prefix, then one token a step
    assert len(seen) == 4 and [s[0] for s in seen[1:]] == [1, 1, 1]
    assert {"DecoderLayer", "Attention", "MLP", "Linear"} <= set(every)


def test_layer_attributes_keep_nn_module_semantics():
    """stage_worker.layers.Module keeps parameters and submodules in the instance dict for fast reads; every
    way nn.Module changes them (set, set to None, delete, swap a module for a parameter, .to()) still shows."""
    from torch import nn

    from stage_worker.layers import Module

    class Layer(Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(2))
            self.sub = nn.Linear(2, 2)

        def forward(self, x):
            return x * self.w

    layer = Layer()
    assert layer.__dict__["w"] is layer._parameters["w"] and layer.__dict__["sub"] is layer._modules["sub"]
    layer.w = nn.Parameter(torch.zeros(2))
    assert layer.w is layer._parameters["w"] and torch.equal(layer(torch.ones(2)), torch.zeros(2))
    layer.w = None
    assert layer.w is None
    del layer.w
    assert not hasattr(layer, "w")
    layer.w = nn.Parameter(torch.ones(2))
    layer.sub = nn.Parameter(torch.ones(1))  # a module swapped for a parameter
    assert layer.sub is layer._parameters["sub"] and "sub" not in layer._modules
    layer.to(torch.float64)
    assert layer.w.dtype == torch.float64 and layer.w is layer._parameters["w"]
    assert sorted(dict(layer.named_parameters())) == ["sub", "w"]


def test_sharded_checkpoint_loads(tmp_path):
    from tiny_models import make_tiny_model

    model_dir = make_tiny_model(tmp_path, "llama", sharded=True)
    assert (model_dir / "model.safetensors.index.json").exists()
    ref = reference_model(model_dir)
    prompt = prompts(384, lengths=(20,))[0]
    tokens, _ = chained_logits(model_dir, [2, 2], prompt, 8)
    assert tokens == reference_tokens(ref, prompt, 8)


@pytest.mark.slow
def test_default_model_matches_transformers(default_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_dir)
    ref = reference_model(default_model_dir)
    texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village"]
    batch = [tok.encode(t) for t in texts]
    want = [reference_tokens(ref, p, NEW_TOKENS) for p in batch]
    with LocalEngine.of(default_model_dir, layer_split=[10, 12, 8], max_num_batched_tokens=8) as engine:
        assert engine.generate(batch, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)) == want
