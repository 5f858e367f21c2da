"""DeepSeek-V3 and V2-Lite (multi-head latent attention, DeepSeekMoE) as stage slices: transformers' logits and
greedy tokens at TP=1 (whole and split), TP=2, TP=2 with expert parallelism and TP=2 with DCP over real gloo
processes; the latent KV cache's size, in the stage and in `stagemesh plan`; every config field honoured or
refused by name."""
from __future__ import annotations

import pytest
import torch

from parity import chained_logits, prompts
from stagemesh.core.errors import StagemeshError
from stagemesh.core.model_config import ModelConfig
from stage_worker.runner import StageRunner
from test_families import assert_layer_shapes_match
from test_tp_parity import run_tp
from tiny_models import reference_greedy, reference_model, tiny_config

TOL = dict(atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch,overrides", [
    ("deepseek_v3", {}),
    ("deepseek_v3", {"rope_interleave": False, "first_k_dense_replace": 2, "n_group": 4, "topk_group": 2}),
    ("deepseek_v2", {}),
    ("deepseek_v2", {"topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 2}),
])
def test_slices_match_transformers(tiny_model_dir, arch, overrides):
    """Prefill chunks (expanded), decode rows (absorbed), one stage and two."""
    model_dir = tiny_model_dir(arch, **overrides)
    assert_layer_shapes_match(model_dir)
    prompt = prompts(384, lengths=(37,))[0]
    want_tokens, want_logits = reference_greedy(reference_model(model_dir), prompt, 8)
    for split in ([4], [1, 3]):
        tokens, logits = chained_logits(model_dir, split, prompt, 8, chunk=16)
        assert tokens == want_tokens, split
        torch.testing.assert_close(logits, want_logits, **TOL)


def test_the_other_ways_of_attending_match_transformers(tiny_model_dir, monkeypatch):
    """Prefill chunks absorbed and decode rows expanded (what benchmarks/bench_mla.py weighs against the
    defaults) give the same logits."""
    from stage_worker.mla import MLAttention

    monkeypatch.setattr(MLAttention, "absorb_prefill", True)
    monkeypatch.setattr(MLAttention, "absorb_decode", False)
    model_dir = tiny_model_dir("deepseek_v3")
    prompt = prompts(384, lengths=(37,))[0]
    want_tokens, want_logits = reference_greedy(reference_model(model_dir), prompt, 8)
    tokens, logits = chained_logits(model_dir, [4], prompt, 8, chunk=16)
    assert tokens == want_tokens
    torch.testing.assert_close(logits, want_logits, **TOL)


@pytest.mark.parametrize("arch,extra", [
    ("deepseek_v3", ()),
    ("deepseek_v3", ("--expert-parallel",)),
    ("deepseek_v3", ("--dcp", "2", "--chunk", "5")),  # each rank half of every block's latents
    ("deepseek_v2", ()),
], ids=["v3-tp2", "v3-tp2-ep2", "v3-tp2-dcp2", "v2-tp2"])
def test_tp2_matches_transformers(tiny_model_dir, tmp_path, arch, extra):
    model_dir = tiny_model_dir(arch)
    prompt = prompts(384, lengths=(37,))[0]
    want_tokens, want_logits = reference_greedy(reference_model(model_dir), prompt, 16)
    got = run_tp(model_dir, 2, "3,1", prompt, 16, tmp_path, False, *extra)
    assert got["tokens"] == want_tokens
    torch.testing.assert_close(torch.tensor(got["logits"]), want_logits, **TOL)


@pytest.mark.slow
def test_dcp_on_the_triton_kernels_matches_transformers(tiny_model_dir, tmp_path):
    """-tp 2 -dcp 2 on the Triton kernels (interpreted on a CPU: STAGEMESH_KERNELS=triton), as CUDA stages run
    them: kernels.triton_mla for every row of a rank's share, the merge kernel."""
    model_dir = tiny_model_dir("deepseek_v3")
    prompt = prompts(384, lengths=(37,))[0]
    want_tokens, want_logits = reference_greedy(reference_model(model_dir), prompt, 6)
    got = run_tp(model_dir, 2, "4", prompt, 6, tmp_path, False, "--dcp", "2", "--chunk", "16",
                 env={"STAGEMESH_KERNELS": "triton", "TRITON_INTERPRET": "1"})
    assert got["tokens"] == want_tokens
    torch.testing.assert_close(torch.tensor(got["logits"]), want_logits, **TOL)


def test_the_cache_holds_the_latent(tiny_model_dir):
    """kv_lora_rank + qk_rope_head_dim values per token and layer, replicated on each TP rank (or split by DCP):
    here 48 against the 4 heads x (32 + 24) of K and V that transformers' expanded cache holds, 4.7x the tokens."""
    model_dir = tiny_model_dir("deepseek_v3")
    runner = StageRunner.of(model_dir, 0, 4, load=False)
    latent = 32 + 16
    assert runner.kv_bytes_per_block == 4 * 16 * latent * 4  # layers x block_size x latent x fp32
    runner.allocate_kv_cache(3)
    assert [tuple(t.shape) for t in runner.kv_caches[0]] == [(3, 16, 1, latent // 2)] * 2
    full_heads = 4 * (16 + 16 + 24)
    assert full_heads / latent > 4.6
    tp = StageRunner.of(model_dir, 0, 4, tp_rank=1, tensor_parallel_size=2, load=False)
    assert tp.kv_bytes_per_block == runner.kv_bytes_per_block


@pytest.mark.parametrize("arch,overrides,why", [
    ("deepseek_v3", {"topk_method": "greedy"}, r"topk_method 'greedy' \(this family's gate picks by noaux_tc\)"),
    ("deepseek_v3", {"scoring_func": "softmax"}, r"scoring_func 'softmax'"),
    ("deepseek_v2", {"scoring_func": "sigmoid"}, r"scoring_func 'sigmoid'"),
    ("deepseek_v2", {"topk_method": "noaux_tc"}, r"topk_method 'noaux_tc'"),
    ("deepseek_v2", {"norm_topk_prob": True}, r"norm_topk_prob true"),
    ("deepseek_v3", {"moe_layer_freq": 2}, r"moe_layer_freq 2"),
    ("deepseek_v3", {"n_group": 3}, r"n_group 3 with topk_group 1 over 8 experts"),
    ("deepseek_v3", {"attention_bias": True}, r"attention_bias"),
    ("deepseek_v3", {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}},
     r"rope scaling 'linear'"),
])
def test_what_is_not_built_is_refused_by_name(arch, overrides, why):
    raw = {**tiny_config(arch).to_dict(), **overrides}
    with pytest.raises(StagemeshError, match=rf"{arch}: {why}.* is not supported"):
        ModelConfig.from_dict(raw)


def test_layouts_not_built_with_latent_attention_are_refused(tiny_model_dir):
    model_dir = tiny_model_dir("deepseek_v3")
    with pytest.raises(StagemeshError, match=r"--prefill-context-parallel-size with multi-head latent attention"):
        StageRunner.of(model_dir, 0, 4, tp_rank=0, tensor_parallel_size=1, prefill_context_parallel_size=2, load=False)


def test_the_plan_of_deepseek_v3_671b_counts_the_latent():
    """`stagemesh plan DeepSeek-V3-671B`: the released block-FP8 checkpoint's 671 B parameters on one node of
    8 H200s at TP=8 with EP=8, or as 8 replicas with the experts across them; BF16 on two nodes, PP=2 across them
    or 16 replicas. A token's KV is the latent: 61 layers x 576 values, 2 bytes each, on every TP rank."""
    from stagemesh.entry.plan.memory import param_counts
    from stagemesh.entry.plan.tree import GB, PlanRequest, make_plan
    from stagemesh.entry.plan.cli import load_config

    cfg, _ = load_config("DeepSeek-V3-671B")
    assert 670e9 < param_counts(cfg).total(cfg.num_hidden_layers) < 673e9
    per_token = 61 * (512 + 64) * 2
    fp8 = make_plan(PlanRequest(cfg, 8, 1, int(141e9), "fp8", 32768))
    lay = fp8.layout
    assert (lay.tp, lay.pp, lay.dp, fp8.expert_parallel) == (8, 1, 1, True)
    assert 80 * GB < lay.weight_bytes_per_gpu < 90 * GB and lay.kv_cache_tokens == lay.kv_bytes_per_gpu // per_token
    assert fp8.alternatives[0].startswith("DP=8 x EP=8 (--data-parallel-size 8 --enable-expert-parallel)")
    assert fp8.alternatives[0].endswith(": fits")
    bf16 = make_plan(PlanRequest(cfg, 8, 2, int(141e9), "bf16", 32768))
    assert "does not fit on 1 node(s)" in " ".join(bf16.path)
    assert (bf16.layout.tp, bf16.layout.pp, bf16.expert_parallel) == (8, 2, True)
    assert bf16.alternatives[0].startswith("DP=16 x EP=16") and bf16.alternatives[0].endswith(": fits")
