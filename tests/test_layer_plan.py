"""stage_worker.layer_plan: a dense decoder layer's kernels called from C++ give the Python layer's bits.

Each model runs twice on the same engine: with the plans, then with a no-op forward hook on every layer's
MLP (which the plan cannot honour, so the layers' own Python runs). Greedy tokens of a batch (prompts chunked
and mixed with decodes) and every logprob of one request (its prompt's and its tokens') must be equal, not
close: the plan calls the same kernels with the same arguments.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from kernels import cpu_ops
from stagemesh.core.sampling_params import SamplingParams
from stagemesh.entry.local_engine import LocalEngine
from gguf_models import write_gguf
from parity import prompts

pytestmark = pytest.mark.skipif(cpu_ops.load() is None, reason="the C++ kernels are not built here")


def layers_of(engine):
    from stage_worker.model import DecoderLayer

    return [m for runner in engine.runners for m in runner.model.modules() if isinstance(m, DecoderLayer)]


def outputs(engine, batch):
    """Greedy tokens of the batch, and one request's prompt and sampled logprobs (exact floats)."""
    tokens = engine.generate(batch, SamplingParams(max_tokens=6, ignore_eos=True))
    scored = [[(e.token_id, e.logprob, e.top_token_ids, e.top_logprobs) for e in out.prompt_logprobs + out.new_logprobs]
              for out in engine.stream(batch[0], SamplingParams(max_tokens=4, ignore_eos=True, logprobs=2,
                                                                prompt_logprobs=2))]
    return tokens, scored


def plans_ran(engine) -> list[bool]:
    return [layer.__dict__["_plan"].cpp is not None for layer in layers_of(engine)]


def without_plans(engine, batch):
    """outputs() with a no-op hook on every layer's MLP: the layers' own Python path."""
    handles = [layer.mlp.register_forward_hook(lambda *_: None) for layer in layers_of(engine)]
    try:
        got = outputs(engine, batch)
        assert not any(plans_ran(engine))
        return got
    finally:
        for h in handles:
            h.remove()


@pytest.fixture(scope="module")
def tiny_gguf(tiny_model_dir, tmp_path_factory):
    model_dir = tiny_model_dir("llama")
    return model_dir, write_gguf(model_dir, tmp_path_factory.mktemp("plan-gguf") / "tiny-Q4_1.gguf", "Q4_1")


@pytest.mark.parametrize("arm", ["fp32", "fp32-long", "bf16", "qwen2-bias", "gguf-q4_1", "w8a8", "w8a16-split"])
def test_plan_gives_the_python_layers_bits(tiny_model_dir, tiny_gguf, arm):
    kwargs = dict(max_num_batched_tokens=24, enable_prefix_caching=False)
    model_dir = tiny_model_dir("qwen2" if arm == "qwen2-bias" else "llama")
    if arm == "bf16":
        kwargs["dtype"] = "bfloat16"
    elif arm == "gguf-q4_1":
        model_dir, path = tiny_gguf
        kwargs.update(quantization="gguf", gguf_file=str(path))
    elif arm == "w8a8":
        kwargs["quantization"] = "w8a8"
    elif arm == "w8a16-split":
        kwargs.update(quantization="w8a16", layer_split=[1, 3])
    batch = prompts(384, lengths=(37, 5, 20))
    if arm == "fp32-long":  # steps of over 256 tokens: oneDNN's products in pieces (stage_worker.layers.onednn_linear)
        kwargs["max_num_batched_tokens"] = 512
        batch = prompts(384, lengths=(300, 5, 60))
    with LocalEngine.of(model_dir, **kwargs) as engine:
        got = outputs(engine, batch)
        assert all(plans_ran(engine))
        assert got == without_plans(engine, batch)
        assert outputs(engine, batch) == got and all(plans_ran(engine))  # the hooks gone, the plans again


def test_no_plan_where_the_layer_is_not_one_it_covers(tiny_model_dir):
    """qk-norm layers (Qwen3) keep the Python path; their tokens are checked against transformers elsewhere."""
    with LocalEngine.of(tiny_model_dir("qwen3")) as engine:
        engine.generate([prompts(384, lengths=(9,))[0]], SamplingParams(max_tokens=2, ignore_eos=True))
        assert not any(plans_ran(engine))


def test_a_replaced_weight_rebuilds_the_plan(tiny_model_dir):
    """A parameter swapped after the plans were built is what the next step reads, on both paths."""
    batch = prompts(384, lengths=(12, 7))
    with LocalEngine.of(tiny_model_dir("llama"), enable_prefix_caching=False) as engine:
        before = outputs(engine, batch)
        for layer in layers_of(engine):
            down = layer.mlp.down_proj
            # the MLPs add nothing now (the packed weight keeps its logical shape)
            down.weight = nn.Parameter(torch.zeros(tuple(down.weight.shape)), requires_grad=False)
        after = outputs(engine, batch)
        assert all(plans_ran(engine))
        assert after != before
        assert after == without_plans(engine, batch)
