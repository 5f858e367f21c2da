"""gpt-oss as published: its experts in MXFP4 (quant_method mxfp4: `_blocks` of packed e2m1 values and `_scales` of
e8m0 exponents per 32, tests/quant_checkpoints.write_mxfp4), the rest bf16. The experts stay packed and each is
dequantised for the step that routes tokens to it; greedy tokens and logits are transformers' on the dequantised
twin in one stage, two, and at -tp 2 over real gloo processes; what it cannot shard is refused by name."""
from __future__ import annotations

import json

import pytest
import torch

from parity import chained_logits, prompts
from quant_checkpoints import write_mxfp4
from stagemesh.core.errors import StagemeshError
from stage_worker.quant_methods.mxfp4 import E2M1, dequantise, quantise
from stage_worker.runner import StageRunner
from test_family_gpt_oss import GPT_OSS
from test_tp_parity import run_tp
from tiny_models import reference_greedy, reference_model, save_random_model

TOL = dict(atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def mxfp4(tmp_path_factory):
    """(MXFP4 checkpoint, transformers on its twin) of a tiny gpt-oss whose experts' 64 intermediate columns give
    each of two TP ranks whole blocks of 32."""
    from transformers import GptOssConfig

    config = GptOssConfig(**{**GPT_OSS, "intermediate_size": 64})
    config.architectures = ["GptOssForCausalLM"]
    base = save_random_model(tmp_path_factory.mktemp("gpt-oss"), config)
    quantised, twin = write_mxfp4(base, tmp_path_factory.mktemp("mxfp4"))
    return quantised, reference_model(twin)


def test_mxfp4_values_are_ocps():
    """e2m1 codes (the low nibble first) times 2^(e8m0 - 127); a value of the format round-trips exactly."""
    blocks = torch.tensor([[[0x21] + [0] * 15]], dtype=torch.uint8)  # codes 1 (0.5) then 2 (1.0)
    w = dequantise(blocks, torch.tensor([[129]], dtype=torch.uint8), torch.float32)
    assert w.shape == (1, 32) and w[0, :3].tolist() == [2.0, 4.0, 0.0]
    values = torch.tensor(E2M1)[torch.randint(0, 16, (3, 64))] * 2.0 ** torch.randint(-4, 4, (3, 2)).repeat_interleave(
        32, 1)
    assert torch.equal(dequantise(*quantise(values), torch.float32), values)


def test_mxfp4_gives_transformers_tokens(mxfp4):
    path, reference = mxfp4
    prompt = prompts(384, lengths=(37,))[0]
    want_tokens, want_logits = reference_greedy(reference, prompt, 8)
    for split in ([4], [1, 3]):
        tokens, logits = chained_logits(path, split, prompt, 8, chunk=16)
        assert tokens == want_tokens, split
        torch.testing.assert_close(logits, want_logits, **TOL)


def test_the_experts_stay_packed(mxfp4):
    """4.25 bits a weight held (uint8 blocks and scales), no dense copy of the experts."""
    path, _ = mxfp4
    experts = StageRunner.of(path, 0, 1).model.layers[0].mlp
    assert experts.packed is not None and experts.packed.gate_up_blocks.dtype == torch.uint8
    assert not hasattr(experts, "gate_up") and not hasattr(experts, "down")
    weights = 8 * 3 * 64 * 64  # experts x (gate, up, down) x hidden x intermediate
    assert experts.packed.nbytes() == weights // 32 * 17  # 16 bytes of e2m1 values and one scale a block of 32
    from stage_worker.quantization import describe

    assert describe(experts) == "1 x mxfp4 experts (0.0 MiB quantised)"  # (the start-up line: 51 KiB)


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp2", "tp2-ep2"])
def test_tp2_pp2_over_gloo_gives_transformers_tokens(mxfp4, tmp_path, expert_parallel):
    """Each TP rank its rows of gate_up's blocks and its 32-column blocks of down's, or (expert parallel) its
    half of the experts' blocks whole."""
    path, reference = mxfp4
    prompt = prompts(384, lengths=(37,))[0]
    want_tokens, want_logits = reference_greedy(reference, prompt, 8)
    got = run_tp(path, 2, "2,2", prompt, 8, tmp_path, expert_parallel)
    assert got["tokens"] == want_tokens
    torch.testing.assert_close(torch.tensor(got["logits"]), want_logits, **TOL)


def test_a_shard_that_cuts_the_blocks_is_refused(mxfp4):
    path, _ = mxfp4
    with pytest.raises(StagemeshError, match=r"intermediate columns 16:32 .* cut the 32-value blocks of down_proj"):
        StageRunner.of(path, 0, 4, tp_rank=1, tensor_parallel_size=4, load=False)


def test_experts_not_converted_are_read_dense(mxfp4, tmp_path):
    """modules_to_not_convert naming a layer's experts: they are bf16 in the checkpoint (no _blocks), read so."""
    path, _ = mxfp4
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"]["modules_to_not_convert"].append("model.layers.0.mlp.experts")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    from stagemesh.core.model_config import ModelConfig
    from stage_worker.quant_methods.mxfp4 import packed_experts

    model_cfg = ModelConfig.from_path(tmp_path)
    assert packed_experts(model_cfg, "model.layers.0.mlp.experts", 0, 64, "cpu") is None
    assert packed_experts(model_cfg, "model.layers.1.mlp.experts", 0, 64, "cpu") is not None


def test_the_plan_counts_the_packed_experts(mxfp4):
    """`stagemesh plan` on the checkpoint: its experts at 17 bytes a block of 32; their biases, attention and router
    bf16."""
    from stagemesh.core.model_config import ModelConfig
    from stagemesh.entry.plan.cli import weights_dtype
    from stagemesh.entry.plan.memory import expert_params, param_counts, weight_bytes

    cfg = ModelConfig.from_path(mxfp4[0])
    assert weights_dtype(cfg, None) == "mxfp4"
    packed, per_layer = 4 * 8 * 3 * 64 * 64, param_counts(cfg).per_layer  # layers x experts x gate, up, down
    assert expert_params(cfg) == packed + 4 * 8 * (128 + 64)  # and their biases
    assert weight_bytes(cfg, "mxfp4", 4, 0) == (4 * per_layer - packed) * 2 + packed * 17 / 32
