"""Quantised checkpoints as their quantizers write them (tests/quant_checkpoints.py): each format's tiny llama
gives transformers' greedy tokens on the same weights dequantised (1 stage, 2 pipeline stages, and -tp 2 over
real gloo processes); every field or tensor stagemesh does not honour is refused by name; no checkpoint
loads with a tensor left unread."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from parity import chained_logits, prompts
from quant_checkpoints import FORMATS, STATIC_FP8, static_activation_hooks, write_quantized
from stagemesh.core.errors import StagemeshError
from stagemesh.core.model_source import QUANTIZATION_METHODS
from stage_worker.quant_methods import flag_names
from stage_worker.quant_weight import QuantizedWeight
from stage_worker.runner import StageRunner
from test_tp_parity import run_tp
from tiny_models import reference_greedy, reference_model, reference_tokens

# TP=2 over processes costs seconds a case: these run in make test-fast, the rest in make test
TP_FAST = ("ct-fp8-channel", "fp8-block", "gptq-int4-desc-act", "awq")


@pytest.fixture(scope="module")
def checkpoint(tiny_model_dir, tmp_path_factory):
    """Factory: (quantised dir, reference model) of the tiny llama in `fmt`, cached."""
    cache: dict = {}

    def make(fmt: str):
        if fmt not in cache:
            quantised, twin = write_quantized(tiny_model_dir("llama"), tmp_path_factory.mktemp(fmt), fmt)
            reference = reference_model(twin)
            if fmt in STATIC_FP8:
                static_activation_hooks(reference)
            cache[fmt] = quantised, reference
        return cache[fmt]

    return make


def test_every_checkpoint_method_is_a_quantization_flag():
    assert set(flag_names()) <= set(QUANTIZATION_METHODS)


# Static activation scales round x to fp8 with 3 mantissa bits: where x / s lies within an fp32 rounding of a
# boundary between two fp8 values, a product summed in another order (the C++ kernels') rounds the next layer's
# input by a whole fp8 step, and the tiny model amplifies it. So these formats' products run on the torch
# reference (x @ W^T, transformers' own order); the kernels are checked against it in test_quant_kernels.
STATIC = STATIC_FP8


@pytest.mark.parametrize("fmt", FORMATS)
def test_format_gives_transformers_greedy_tokens(checkpoint, fmt, monkeypatch):
    """One stage (logits within fp32 tolerance of transformers on the dequantised weights) and two stages."""
    if fmt in STATIC:
        monkeypatch.setattr("kernels.cpu_ops.quant_takes", lambda qs: False)
    path, reference = checkpoint(fmt)
    prompt = prompts(384, lengths=(29,))[0]
    want_tokens, want_logits = reference_greedy(reference, prompt, 8)
    tokens, logits = chained_logits(path, [4], prompt, 8)
    assert tokens == want_tokens
    torch.testing.assert_close(logits, want_logits, atol=2e-4, rtol=1e-4)
    assert chained_logits(path, [2, 2], prompt, 8)[0] == want_tokens


@pytest.mark.parametrize("fmt", [f if f in TP_FAST else pytest.param(f, marks=pytest.mark.slow) for f in FORMATS])
def test_format_tp2_pp2_gives_transformers_greedy_tokens(checkpoint, fmt, tmp_path):
    """-tp 2 (scales sharded with their weights; desc_act's columns cut across groups) over two stages."""
    path, reference = checkpoint(fmt)
    prompt = prompts(384, lengths=(21,))[0]
    got = run_tp(path, 2, "2,2", prompt, 8, tmp_path, env={"STAGEMESH_KERNELS": "torch"} if fmt in STATIC else None)
    assert got["tokens"] == reference_tokens(reference, prompt, 8)


def test_weights_stay_quantised(checkpoint):
    """The linears hold the checkpoint's quants (1 byte or half of one a weight), not a float copy."""
    path, _ = checkpoint("gptq-int4-desc-act")
    runner = StageRunner.of(path, 0, 1)
    layer = runner.model.layers[0]
    for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
        assert isinstance(linear.weight, QuantizedWeight) and linear.weight.qs.dtype == torch.uint8
    fp8 = StageRunner.of(checkpoint("fp8-block")[0], 0, 1).model.layers[0].mlp.down_proj.weight
    assert isinstance(fp8, QuantizedWeight) and fp8.qs.dtype == torch.float8_e4m3fn


def _mutated(path, tmp_path, config=None, tensors=None):
    """A copy of a checkpoint with its quantization_config changed (config(qc)) or its tensors (tensors(dict))."""
    target = tmp_path / "mutated"
    shutil.copytree(path, target)
    if config is not None:  # (ModelOpt's older checkpoints keep it in hf_quant_config.json)
        hf_quant = target / "hf_quant_config.json"
        if hf_quant.is_file():
            qc = json.loads(hf_quant.read_text())
            config(qc["quantization"])
            hf_quant.write_text(json.dumps(qc))
        else:
            cfg = json.loads((target / "config.json").read_text())
            config(cfg["quantization_config"])
            (target / "config.json").write_text(json.dumps(cfg))
    if tensors is not None:
        t = load_file(target / "model.safetensors")
        tensors(t)
        save_file(t, target / "model.safetensors", metadata={"format": "pt"})
    return target


def _set(key, value):
    return lambda qc: qc.__setitem__(key, value)


def _nan(name):
    return lambda t: t.__setitem__(name, torch.full_like(t[name], float("nan")))


L0 = "model.layers.0"
REFUSALS = [
    ("gptq-int4", dict(config=_set("bits", 3)), "bits = 3 is not built"),
    ("gptq-int4", dict(config=_set("group_size", 64)), "scales has shape .* want"),
    ("gptq-int4", dict(config=_set("dynamic", {"-:.*down_proj": {}})), "dynamic"),
    ("gptq-int4", dict(config=_set("checkpoint_format", "marlin")), "checkpoint_format = 'marlin'"),
    ("gptq-int4", dict(config=_set("some_new_field", 1)), "field 'some_new_field' is not honoured"),
    ("gptq-int8", dict(config=_set("sym", False)), "sym = false with bits = 8"),
    ("gptq-int4-desc-act", dict(tensors=lambda t: t[f"{L0}.mlp.up_proj.g_idx"].__setitem__(0, 9)),
     r"up_proj.g_idx holds groups outside 0..1"),
    ("gptq-int4-desc-act", dict(tensors=lambda t: t.pop(f"{L0}.self_attn.o_proj.g_idx")),
     "desc_act is true and the checkpoint has no .*o_proj.g_idx"),
    ("gptq-int4", dict(tensors=_nan(f"{L0}.mlp.down_proj.scales")), "down_proj.scales holds non-finite"),
    ("awq", dict(config=_set("zero_point", False)), "zero_point = False is not built"),
    ("awq", dict(config=_set("version", "gemv")), "version = 'gemv' is not built"),
    ("awq", dict(config=_set("bits", 8)), "bits = 8"),
    ("fp8-block", dict(config=_set("weight_block_size", [64, 64])), "weight_scale_inv has shape .* wants"),
    ("fp8-block", dict(config=_set("activation_scheme", "static")), "activation_scheme 'static' with weight_block"),
    ("fp8-block", dict(tensors=lambda t: t.pop(f"{L0}.self_attn.k_proj.weight_scale_inv")),
     "no tensor model.layers.0.self_attn.k_proj.weight_scale_inv"),
    ("fbgemm-fp8", dict(config=_set("activation_scale_ub", -1)), "activation_scale_ub"),
    ("fbgemm-fp8", dict(config=_set("modules_to_not_convert", ["lm_head"])),
     r"layers.1.self_attn.q_proj.weight is stored as torch.float32; the config says float8"),
    ("ct-fp8-tensor-static", dict(tensors=lambda t: t.pop(f"{L0}.mlp.gate_proj.input_scale")),
     "static input_activations need model.layers.0.mlp.gate_proj.input_scale"),
    ("ct-fp8-channel", dict(config=lambda qc: qc["config_groups"]["group_0"]["input_activations"].__setitem__(
        "symmetric", False)), "symmetric = False is not built"),
    ("ct-fp8-channel", dict(config=_set("kv_cache_scheme", {"num_bits": 8})), "kv_cache_scheme has no type"),
    ("ct-fp8-channel", dict(config=_set("format", "marlin-24")), "format = 'marlin-24'"),
    ("ct-w4a16", dict(config=lambda qc: qc["config_groups"]["group_0"]["weights"].__setitem__("group_size", 16)),
     "weight_scale has shape .* want"),
    ("ct-w4a16", dict(config=lambda qc: qc["config_groups"]["group_0"]["weights"].__setitem__("actorder", "group")),
     "actorder = 'group' is not built"),
    ("ct-int8", dict(tensors=lambda t: t.__setitem__(f"{L0}.mlp.up_proj.weight_zero_point",
                                                     torch.ones(128, 1, dtype=torch.int8))),
     "up_proj.weight_zero_point holds non-zero zero points"),
    ("modelopt-fp8", dict(config=_set("quant_algo", "NVFP4")), r"quant_algo 'NVFP4' is not built"),
    ("modelopt-fp8", dict(tensors=lambda t: t.pop(f"{L0}.mlp.gate_proj.input_scale")),
     "quant_algo FP8 quantises activations statically with model.layers.0.mlp.gate_proj.input_scale"),
    ("modelopt-fp8", dict(tensors=lambda t: t.__setitem__(f"{L0}.mlp.up_proj.weight_scale", torch.ones(128))),
     r"up_proj.weight_scale has shape \[128\]; quant_algo FP8 stores one scale a tensor"),
    ("modelopt-fp8", dict(config=lambda qc: qc["config_groups"]["group_0"]["weights"].__setitem__("num_bits", 4)),
     "config_groups.group_0.weights = .* does not describe quant_algo FP8"),
    # hf_quant_config.json: without the wildcard, layer 1's dense MLP would be read as fp8
    ("modelopt-fp8-pcpt", dict(config=_set("exclude_modules", ["lm_head"])),
     r"layers.1.mlp.gate_proj.weight is stored as torch.float32; the config says float8"),
    ("ct-fp8-channel", dict(config=_set("quant_method", "mxfp4")),
     "'mxfp4' is built for model_type gpt_oss, not llama"),
    ("ct-fp8-channel", dict(config=_set("quant_method", "nonesuch")), "'nonesuch' is not built"),
    # an extra tensor of a layer (an adapter, a scale the config does not mention) is never ignored
    ("gptq-int4", dict(tensors=lambda t: t.__setitem__(f"{L0}.mlp.down_proj.weight_scale", torch.ones(1))),
     "tensors stagemesh does not read: model.layers.0.mlp.down_proj.weight_scale"),
]


@pytest.mark.parametrize("fmt,change,match", REFUSALS, ids=[m.split(" ")[0][:24] + "-" + f for f, _, m in REFUSALS])
def test_refused_by_name(checkpoint, tmp_path, fmt, change, match):
    path = _mutated(checkpoint(fmt)[0], tmp_path, **change)
    with pytest.raises(StagemeshError, match=match):
        StageRunner.of(path, 0, 2)


def test_a_quantised_checkpoint_without_its_config_is_refused(checkpoint, tmp_path):
    """The defect this guards: fp8 weights whose scales were ignored answered garbage. Without a
    quantization_config the fp8 tensors and their scales are refused, never cast."""
    path = _mutated(checkpoint("ct-fp8-channel")[0], tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    del cfg["quantization_config"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(StagemeshError, match="stored as torch.float8_e4m3fn: quantised"):
        StageRunner.of(path, 0, 2)


def test_modelopt_hf_quant_config_is_read_where_config_json_has_none(checkpoint, tmp_path):
    """ModelOpt's older checkpoints say their scheme in hf_quant_config.json: read as vLLM reads it (and named by
    --quantization modelopt); one that is not ModelOpt's is refused; config.json's own quantization_config wins."""
    path = _mutated(checkpoint("modelopt-fp8-pcpt")[0], tmp_path)
    assert StageRunner.of(path, 0, 1, quantization="modelopt").quantization == "modelopt"
    (path / "hf_quant_config.json").write_text(json.dumps({"producer": {"name": "modelopt"}}))
    with pytest.raises(StagemeshError, match="hf_quant_config.json has no quantization object"):
        StageRunner.of(path, 0, 1)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "quantization_config": {"quant_method": "modelopt",
                                                                                 "quant_algo": "FP8"}}))
    with pytest.raises(StagemeshError, match="weight_scale has shape .*; quant_algo FP8 stores one scale a tensor"):
        StageRunner.of(path, 0, 1)


def test_quantization_flag_must_match_the_checkpoint(checkpoint, tiny_model_dir):
    path, _ = checkpoint("awq")
    with pytest.raises(StagemeshError, match="--quantization gptq does not match .* 'awq'"):
        StageRunner.of(path, 0, 1, quantization="gptq")
    assert StageRunner.of(path, 0, 1, quantization="awq_marlin").quantization == "awq_marlin"
    with pytest.raises(StagemeshError, match="--quantization awq reads a checkpoint .* no quantization_config"):
        StageRunner.of(tiny_model_dir("llama"), 0, 1, quantization="awq")


def test_an_unquantised_checkpoint_with_an_extra_tensor_is_refused(tiny_model_dir, tmp_path):
    path = _mutated(tiny_model_dir("llama"), tmp_path, tensors=lambda t: t.__setitem__(
        "model.layers.3.self_attn.q_proj.weight_scale", torch.ones(64, 1)))
    StageRunner.of(path, 0, 2)  # layer 3 is another stage's
    with pytest.raises(StagemeshError, match="does not read: model.layers.3.self_attn.q_proj.weight_scale"):
        StageRunner.of(path, 2, 4)


def test_the_plan_counts_the_quantised_bytes(checkpoint):
    from stagemesh.core.model_config import ModelConfig
    from stagemesh.entry.plan.cli import weights_dtype
    from stagemesh.entry.plan.memory import weight_bytes

    for fmt, dtype in (("gptq-int4", "int4"), ("fbgemm-fp8", "fp8"), ("ct-int8", "int8"), ("ct-w4a16", "int4")):
        cfg = ModelConfig.from_path(checkpoint(fmt)[0])
        assert weights_dtype(cfg, None) == dtype
    assert weight_bytes(cfg, "int4", 4, 0) < 0.3 * weight_bytes(cfg, "bf16", 4, 0)
    with pytest.raises(StagemeshError, match="stored as int4 .* --dtype bf16"):
        weights_dtype(cfg, "bf16")


@pytest.fixture(scope="module")
def fp8_moe(tiny_model_dir, tmp_path_factory):
    """A tiny Qwen3-MoE in compressed-tensors FP8 (experts too; routers dense), and its reference."""
    quantised, twin = write_quantized(tiny_model_dir("qwen3_moe"), tmp_path_factory.mktemp("moe"), "ct-fp8-channel")
    return quantised, reference_model(twin)


def test_fp8_moe_gives_transformers_greedy_tokens(fp8_moe):
    path, reference = fp8_moe
    prompt = prompts(384, lengths=(23,))[0]
    want_tokens, want_logits = reference_greedy(reference, prompt, 6)
    tokens, logits = chained_logits(path, [2, 2], prompt, 6)
    assert tokens == want_tokens
    torch.testing.assert_close(logits, want_logits, atol=2e-4, rtol=1e-4)
    experts = StageRunner.of(path, 0, 1).model.layers[0].mlp.quantised
    assert experts is not None and experts.w13[0].qs.dtype == torch.float8_e4m3fn


def test_modelopt_moe_gives_transformers_greedy_tokens(tiny_model_dir, tmp_path):
    """ModelOpt's FP8 per channel on a tiny Qwen3-MoE, its hf_quant_config.json excluding layer 1's MLP (experts
    and all) by a wildcard; the routers dense, as vLLM keeps them."""
    path, twin = write_quantized(tiny_model_dir("qwen3_moe"), tmp_path, "modelopt-fp8-pcpt")
    prompt = prompts(384, lengths=(17,))[0]
    want_tokens, want_logits = reference_greedy(reference_model(twin), prompt, 6)
    tokens, logits = chained_logits(path, [4], prompt, 6)
    assert tokens == want_tokens
    torch.testing.assert_close(logits, want_logits, atol=2e-4, rtol=1e-4)
    layers = StageRunner.of(path, 0, 2).model.layers
    assert layers[0].mlp.quantised.w13[0].qs.dtype == torch.float8_e4m3fn and layers[1].mlp.quantised is None


def test_fp8_moe_expert_parallel_gives_transformers_greedy_tokens(fp8_moe, tmp_path):
    """-tp 2 --enable-expert-parallel: each rank reads its experts' quants and scales only."""
    path, reference = fp8_moe
    prompt = prompts(384, lengths=(19,))[0]
    got = run_tp(path, 2, "2,2", prompt, 6, tmp_path, True)
    assert got["tokens"] == reference_tokens(reference, prompt, 6)


def test_lora_on_a_quantised_checkpoint(checkpoint, tiny_model_dir, tmp_path):
    """An adapter on GPTQ desc_act weights (their products gather x's columns; the adapter's take x as it is):
    transformers on the dequantised weights with the adapter merged."""
    from lora_cases import make_adapter, merged_reference, run_mixed, runners, settings

    path, _ = checkpoint("gptq-int4-desc-act")
    twin = path.parent / "dequantised"
    adapter = make_adapter(tmp_path / "all", tiny_model_dir("llama"), rank=8, seed=1)
    ps = prompts(384, lengths=(13, 21), seed=7)
    want = [reference_tokens(merged_reference(twin, adapter), ps[0], 8),
            reference_tokens(merged_reference(twin, None), ps[1], 8)]
    assert want[0] != reference_tokens(merged_reference(twin, None), ps[0], 8), "the adapter changes nothing"
    stages = runners(path, [2, 2], settings({"all": adapter}))
    assert run_mixed(stages, [(ps[0], "all"), (ps[1], "")], 8) == want


@pytest.mark.slow
def test_an_fp8_checkpoint_served_by_a_mesh(checkpoint, tmp_path):
    """The user's path: stage processes (a -tp 2 stage with its follower, and a second stage) read an fbgemm_fp8
    checkpoint's own quantization_config, and the router answers with transformers' tokens on its dequantised
    weights."""
    from mesh import Mesh, Router, completion_ids
    from tiny_models import with_word_tokenizer

    path, reference = checkpoint("fbgemm-fp8")
    served = with_word_tokenizer(path, tmp_path / "served")
    with Mesh(served, [2, 2], tp=[2, 1], log_dir=tmp_path) as mesh:
        with Router(served, [mesh.address], log_dir=tmp_path) as router:
            for prompt in prompts(384, lengths=(7, 30)):
                assert completion_ids(router.base_url, str(served), prompt, 6) == reference_tokens(reference, prompt,
                                                                                                  6)
    assert "--quantization fbgemm_fp8: " in "".join(f.read_text() for f in tmp_path.glob("*.log"))
