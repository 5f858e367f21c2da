"""DeepSeek-V3 as published: block FP8 (quant_method fp8, e4m3, dynamic activations, weight_scale_inv per block of
every linear of attention, dense MLPs, shared and routed experts; the gate, norms and embeddings dense), written by
tests/quant_checkpoints.py as DeepSeek's checkpoint is (a partial block's scale from its zero-padded block). Greedy
tokens and logits are transformers' on the dequantised twin in one stage and two, at -tp 2 with and without expert
parallelism over real gloo processes, and through the MTP layer (deepseek_mtp); the weights stay fp8 but kv_b_proj,
dequantised once at load for absorbed decode; the plan counts the released checkpoint's bytes."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from parity import chained_logits, prompts
from quant_checkpoints import write_quantized
from stage_worker.quant_weight import QuantizedWeight
from stage_worker.runner import StageRunner
from test_tp_parity import run_tp
from tiny_models import make_tiny_model, reference_greedy, reference_model, reference_tokens, with_mtp_layer

TOL = dict(atol=2e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def fp8_v3(tiny_model_dir, tmp_path_factory):
    """(block-FP8 checkpoint, transformers on its dequantised twin) of the tiny V3 (blocks of 32: its widths of 48
    leave partial blocks, as V3's kv_a_proj_with_mqa's 576 rows do of 128)."""
    quantised, twin = write_quantized(tiny_model_dir("deepseek_v3"), tmp_path_factory.mktemp("v3-fp8"), "fp8-block")
    return quantised, reference_model(twin)


def test_block_fp8_v3_gives_transformers_tokens(fp8_v3):
    """Prefill chunks (expanded through the dequantised kv_b_proj), decode rows (absorbed), one stage and two."""
    path, reference = fp8_v3
    prompt = prompts(384, lengths=(37,))[0]
    want_tokens, want_logits = reference_greedy(reference, prompt, 8)
    for split in ([4], [1, 3]):
        tokens, logits = chained_logits(path, split, prompt, 8, chunk=16)
        assert tokens == want_tokens, split
        torch.testing.assert_close(logits, want_logits, **TOL)


def test_the_weights_stay_fp8_but_kv_b_proj(fp8_v3):
    """Every linear holds the checkpoint's fp8 quants and block scales; kv_b_proj (W_UK, W_UV) is the dequantised
    twin's, exactly; the router stays dense."""
    path, _ = fp8_v3
    model = StageRunner.of(path, 0, 2).model
    twin = load_file(path.parent / "dequantised" / "model.safetensors")
    dense, sparse = model.layers[0], model.layers[1]
    linears = [layer.self_attn.qkv_a_proj.weight for layer in (dense, sparse)] + \
        [dense.self_attn.q_b_proj.weight, dense.self_attn.o_proj.weight, dense.mlp.gate_up_proj.weight,
         sparse.mlp.shared_expert.down_proj.weight, *sparse.mlp.quantised.w13, *sparse.mlp.quantised.w2]
    assert all(isinstance(w, QuantizedWeight) and w.qs.dtype == torch.float8_e4m3fn for w in linears)
    for i, layer in enumerate((dense, sparse)):
        assert torch.equal(layer.self_attn.kv_b_proj, twin[f"model.layers.{i}.self_attn.kv_b_proj.weight"])
    assert sparse.mlp.gate.weight.dtype == torch.float32


@pytest.mark.parametrize("extra", [(), ("--expert-parallel",)], ids=["tp2", "tp2-ep2"])
def test_tp2_over_two_stages_gives_transformers_tokens(fp8_v3, tmp_path, extra):
    """-tp 2 (each rank its heads' rows of q_b_proj and kv_b_proj, blocks cut by the shards; o_proj's columns) or
    -tp 2 --enable-expert-parallel (each rank its experts' quants and scales), over two stages."""
    path, reference = fp8_v3
    prompt = prompts(384, lengths=(37,))[0]
    want_tokens, want_logits = reference_greedy(reference, prompt, 8)
    got = run_tp(path, 2, "3,1", prompt, 8, tmp_path, False, *extra)
    assert got["tokens"] == want_tokens
    torch.testing.assert_close(torch.tensor(got["logits"]), want_logits, **TOL)


def test_the_mtp_layer_drafts_from_fp8_weights(tmp_path):
    """deepseek_mtp on a block-FP8 checkpoint: its MTP layer's decoder layer fp8 (eh_proj, norms and shared head
    dense, as V3's). It copies the main path, so its drafts are accepted only if it computes from its fp8 weights
    as the main path does; the tokens are transformers' on the dequantised twin."""
    from stagemesh.core.sampling_params import SamplingParams
    from stagemesh.entry.local_engine import LocalEngine

    base = make_tiny_model(tmp_path / "base", "deepseek_v3", num_hidden_layers=1, first_k_dense_replace=0)
    quantised, twin = write_quantized(with_mtp_layer(base, tmp_path / "mtp", copy_of=0), tmp_path / "fp8",
                                      "fp8-block")
    reference = reference_model(twin)
    batch = prompts(384, (5, 40, 17))
    want = [reference_tokens(reference, p, 12) for p in batch]
    spec = {"method": "deepseek_mtp", "num_speculative_tokens": 2}
    with LocalEngine.of(quantised, speculative_config=spec) as engine:
        assert engine.generate(batch, SamplingParams(max_tokens=12, ignore_eos=True)) == want
        s = engine.stats().spec_decode
    assert s.num_accepted_tokens > s.num_draft_tokens // 2, s


def test_the_plan_counts_the_released_checkpoints_bytes():
    """`stagemesh plan DeepSeek-V3-671B --dtype fp8`: the main model's tensors as the released checkpoint stores
    them (fp8 linears with an fp32 scale per 128x128 block, partial blocks too; gates, norms, embeddings bf16; the
    correction bias fp32). With the MTP layer (eh_proj, its norms, embedding and head bf16) they are the published
    files' 688,586,727,753 bytes less their safetensors headers (~130 bytes for each of ~92,000 tensors)."""
    from stagemesh.entry.plan.cli import load_config
    from stagemesh.entry.plan.memory import _block_fp8_bytes, param_counts, weight_bytes

    cfg, _ = load_config("DeepSeek-V3-671B")
    counts = param_counts(cfg)
    main = weight_bytes(cfg, "fp8", cfg.num_hidden_layers, counts.embedding + counts.lm_head + counts.final_norm)
    assert abs(main - 673_150_611_808) < 64
    h, mtp_layer = cfg.hidden_size, cfg.family.layer_shapes(cfg, cfg.num_hidden_layers, sparse=True)
    mtp = _block_fp8_bytes(mtp_layer, (128, 128)) + 2 * (2 * h * h + 3 * h + counts.embedding + counts.lm_head)
    headers = 688_586_727_753 - (main + mtp)
    assert 10e6 < headers < 14e6
