"""The mixture-of-experts kernels: the torch reference against transformers' routers and experts,
and the Triton kernel (TRITON_INTERPRET=1 on CPU) and the C++ CPU kernel against the reference."""
from __future__ import annotations

import pytest
import torch

from kernels import cpu_ops, moe_reference
from stagemesh.core.errors import StagemeshError

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = dict(atol=2e-5, rtol=2e-5)

CASES = {  # tokens, hidden, intermediate, experts in the model, top_k, first local expert, local experts
    "decode-8-experts-top2": (5, 64, 32, 8, 2, 0, 8),
    "batch32-second-half-of-experts": (32, 128, 96, 8, 2, 4, 4),
    "prefill-groups-past-64-rows": (150, 64, 48, 4, 2, 0, 4),
    "top3-middle-experts-odd-sizes": (7, 96, 40, 6, 3, 2, 2),
    "one-token": (1, 64, 32, 8, 2, 0, 8),
    "top1": (9, 64, 32, 4, 1, 0, 4),
}


def moe_case(tokens, hidden, inter, experts, top_k, start, local, renormalize=True, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g)
    w13 = torch.randn(local, 2 * inter, hidden, generator=g) * hidden ** -0.5
    w2 = torch.randn(local, hidden, inter, generator=g) * inter ** -0.5
    weights, ids = moe_reference.select_experts(torch.randn(tokens, experts, generator=g), top_k, renormalize)
    return tuple(t.to(device) for t in (x, w13, w2, weights, ids)) + (start,)


@pytest.mark.parametrize("renormalize", [True, False])
def test_select_experts_matches_transformers_routers(renormalize):
    from transformers import Qwen2MoeConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralConfig, MixtralTopKRouter
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter

    g = torch.Generator().manual_seed(1)
    x = torch.randn(11, 64, generator=g)
    if renormalize:  # Mixtral always renormalises
        router = MixtralTopKRouter(MixtralConfig(hidden_size=64, num_local_experts=8, num_experts_per_tok=2))
    else:
        router = Qwen2MoeTopKRouter(Qwen2MoeConfig(hidden_size=64, num_experts=8, num_experts_per_tok=2,
                                                   norm_topk_prob=False))
    router.weight.data.normal_(0, 0.3, generator=g)
    _, want_weights, want_ids = router(x)
    weights, ids = moe_reference.select_experts(x @ router.weight.T, 2, renormalize)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_weights.float(), atol=1e-6, rtol=1e-6)
    assert torch.allclose(weights.sum(-1), torch.ones(11)) == renormalize


def test_reference_matches_transformers_experts():
    from transformers.models.mixtral.modeling_mixtral import MixtralConfig, MixtralExperts

    x, w13, w2, weights, ids, _ = moe_case(*CASES["batch32-second-half-of-experts"][:4], 2, 0, 8)
    experts = MixtralExperts(MixtralConfig(hidden_size=128, intermediate_size=96, num_local_experts=8))
    experts.gate_up_proj.data.copy_(w13)  # transformers stacks experts as we do: cat(gate, up) and down
    experts.down_proj.data.copy_(w2)
    torch.testing.assert_close(moe_reference.fused_moe(x, w13, w2, weights, ids), experts(x, ids, weights), **TOL)


def test_ranks_holding_halves_of_the_experts_sum_to_the_whole():
    x, w13, w2, weights, ids, _ = moe_case(16, 64, 32, 8, 2, 0, 8)
    halves = [moe_reference.fused_moe(x, w13[s:s + 4], w2[s:s + 4], weights, ids, s) for s in (0, 4)]
    torch.testing.assert_close(halves[0] + halves[1], moe_reference.fused_moe(x, w13, w2, weights, ids), **TOL)
    assert halves[0].abs().sum() > 0 and halves[1].abs().sum() > 0


@pytest.mark.parametrize("name", list(CASES))
def test_triton_fused_moe_equals_reference(name):
    triton_moe = pytest.importorskip("kernels.triton_moe")
    args = moe_case(*CASES[name], device=DEVICE)
    torch.testing.assert_close(triton_moe.fused_moe(*args), moe_reference.fused_moe(*args), **TOL)


def test_triton_align_groups_slots_by_expert_in_whole_blocks():
    triton_moe = pytest.importorskip("kernels.triton_moe")
    ids = torch.tensor([[5, 2], [2, 7], [3, 2], [0, 5]])  # local experts 2..5 (start 2, 4 of them)
    slots, block_experts = triton_moe.align_slots(ids, 2, 4, 4)
    # local 0 (global 2): slots 1, 2, 5; local 1: slot 4; local 3: slots 0, 7; slots 3 and 6 are elsewhere
    # sized for the worst case without looking: 8 slots + 4 groups x 3 padding, in blocks of 4
    assert slots.tolist() == [1, 2, 5, 8, 4, 8, 8, 8, 0, 7, 8, 8] + [8] * 8
    assert block_experts.tolist() == [0, 1, 3, -1, -1]


@pytest.mark.parametrize("name", list(CASES))
def test_cpu_fused_moe_equals_reference(name):
    if cpu_ops.load() is None:
        pytest.skip("the CPU kernels could not be built here (no C++ compiler?)")
    args = moe_case(*CASES[name])
    torch.testing.assert_close(cpu_ops.fused_moe(*args), moe_reference.fused_moe(*args), **TOL)


def test_cpu_fused_moe_takes_a_strided_input():
    if cpu_ops.load() is None:
        pytest.skip("the CPU kernels could not be built here (no C++ compiler?)")
    x, w13, w2, weights, ids, start = moe_case(*CASES["decode-8-experts-top2"])
    wide = torch.randn(x.shape[0], 2 * x.shape[1])
    wide[:, ::2] = x
    torch.testing.assert_close(cpu_ops.fused_moe(wide[:, ::2], w13, w2, weights, ids, start),
                               moe_reference.fused_moe(x, w13, w2, weights, ids, start), **TOL)


def test_bad_inputs_are_refused():
    x, w13, w2, weights, ids, _ = moe_case(*CASES["decode-8-experts-top2"])
    with pytest.raises(StagemeshError, match=r"w2 \(8, 32, 64\) must be \(8, 64, 32\)"):
        moe_reference.fused_moe(x, w13, w2.transpose(1, 2), weights, ids)
    with pytest.raises(StagemeshError, match="topk_ids must be int64"):
        moe_reference.fused_moe(x, w13, w2, weights, ids.int())
    with pytest.raises(StagemeshError, match="same shape"):
        moe_reference.fused_moe(x, w13, w2, weights[:, :1], ids)
