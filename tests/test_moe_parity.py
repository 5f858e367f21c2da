"""Mixture-of-experts slices (Mixtral, Qwen2-MoE, Qwen3-MoE) match transformers at TP=1, TP=2 and
TP=2 with expert parallelism over real gloo processes; each rank holds only its experts."""
from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from parity import chained_logits, prompts
from stagemesh.entry.local_engine import LocalEngine
from stagemesh.core.errors import StagemeshError
from stagemesh.core.sampling_params import SamplingParams
from stage_worker.moe import expert_load
from stage_worker.runner import StageRunner
from test_tp_parity import run_tp
from tiny_models import MOE_ARCHS, reference_greedy, reference_model, reference_tokens

TOL = dict(atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch,overrides", [
    *((arch, {}) for arch in MOE_ARCHS),
    ("qwen2_moe", {"decoder_sparse_step": 2}),  # layers 0 and 2 dense, 1 and 3 sparse
    ("qwen3_moe", {"mlp_only_layers": [0, 3]}),
])
def test_slices_match_transformers_logits(tiny_model_dir, arch, overrides):
    model_dir = tiny_model_dir(arch, **overrides)
    prompt = prompts(384, lengths=(37,))[0]
    want_tokens, want_logits = reference_greedy(reference_model(model_dir), prompt, 8)
    for split in ([4], [1, 3]):
        tokens, logits = chained_logits(model_dir, split, prompt, 8, chunk=16)
        assert tokens == want_tokens, split
        torch.testing.assert_close(logits, want_logits, **TOL)


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_batched_greedy_tokens_match_transformers(tiny_model_dir, arch):
    model_dir = tiny_model_dir(arch)
    ref = reference_model(model_dir)
    batch = prompts(384)
    want = [reference_tokens(ref, p, 16) for p in batch]
    with LocalEngine.of(model_dir, layer_split=[2, 2], max_num_batched_tokens=24) as engine:  # chunked prefill, decodes
        assert engine.generate(batch, SamplingParams(max_tokens=16, ignore_eos=True)) == want


@pytest.mark.parametrize("arch", MOE_ARCHS)
@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp2", "tp2-ep2"])
def test_tp2_matches_transformers(tiny_model_dir, tmp_path, arch, expert_parallel):
    model_dir = tiny_model_dir(arch)
    prompt = prompts(384, lengths=(37,))[0]
    want_tokens, want_logits = reference_greedy(reference_model(model_dir), prompt, 16)
    got = run_tp(model_dir, 2, "3,1", prompt, 16, tmp_path, expert_parallel=expert_parallel)
    assert got["tokens"] == want_tokens
    torch.testing.assert_close(torch.tensor(got["logits"]), want_logits, **TOL)


def _checkpoint_tensor(model_dir, name: str) -> torch.Tensor:
    with safe_open(model_dir / "model.safetensors", framework="pt") as f:
        return f.get_tensor(name)


def test_each_rank_holds_only_its_experts(tiny_model_dir):
    model_dir = tiny_model_dir("mixtral")
    expert = "model.layers.2.block_sparse_moe.experts.{}.{}.weight"
    ep = StageRunner.of(model_dir, 2, 4, tp_rank=1, tensor_parallel_size=2,
                        enable_expert_parallel=True).model.layers[0].mlp
    assert ep.placement.expert_start == 4 and ep.w13.shape == (4, 64, 64) and ep.w2.shape == (4, 64, 32)
    for local, e in enumerate(range(4, 8)):  # whole experts 4..7: gate (w1) and up (w3) rows, down (w2)
        want = torch.cat([_checkpoint_tensor(model_dir, expert.format(e, w)) for w in ("w1", "w3")])
        assert torch.equal(ep.w13[local], want)
        assert torch.equal(ep.w2[local], _checkpoint_tensor(model_dir, expert.format(e, "w2")))
    tp = StageRunner.of(model_dir, 2, 4, tp_rank=1, tensor_parallel_size=2).model.layers[0].mlp
    assert tp.w13.shape == (8, 32, 64) and tp.w2.shape == (8, 64, 16)  # every expert, columns 16:32 of 32
    assert torch.equal(tp.w13[5, :16], _checkpoint_tensor(model_dir, expert.format(5, "w1"))[16:])
    assert torch.equal(tp.w2[5], _checkpoint_tensor(model_dir, expert.format(5, "w2"))[:, 16:])


def test_expert_parallel_layouts_that_cannot_work_are_refused(tiny_model_dir):
    with pytest.raises(StagemeshError, match=r"6 experts do not split evenly over --tensor-parallel-size 4 ranks"):
        StageRunner.of(tiny_model_dir("mixtral", num_local_experts=6), 0, 4, tensor_parallel_size=4,
                       enable_expert_parallel=True)
    with pytest.raises(StagemeshError, match="needs a mixture-of-experts model; llama has no experts"):
        StageRunner.of(tiny_model_dir("llama"), 0, 4, tensor_parallel_size=2, enable_expert_parallel=True)
    with pytest.raises(StagemeshError, match=r"moe_intermediate_size \(34\) is not divisible by "
                                             r"--tensor-parallel-size 4"):
        StageRunner.of(tiny_model_dir("qwen3_moe", num_key_value_heads=4, moe_intermediate_size=34), 0, 4,
                       tensor_parallel_size=4)


def test_expert_load_counts_every_routed_token(tiny_model_dir):
    with LocalEngine.of(tiny_model_dir("qwen2_moe", decoder_sparse_step=2), layer_split=[4],
                        max_num_batched_tokens=24) as engine:
        assert expert_load(engine.runners[0].model) == {1: [0] * 8, 3: [0] * 8}  # the sparse layers only
        engine.generate(prompts(384, lengths=(5, 40)), SamplingParams(max_tokens=6, ignore_eos=True))
        load = expert_load(engine.runners[0].model)
    tokens = 5 + 40 + 2 * 5  # the prompts, then one decode token per generated token but the last
    assert {layer: sum(counts) for layer, counts in load.items()} == {1: tokens * 2, 3: tokens * 2}  # top-2
    assert all(min(counts) < max(counts) for counts in load.values())  # per expert, not spread evenly
