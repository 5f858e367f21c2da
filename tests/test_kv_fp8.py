"""--kv-cache-dtype fp8 in a stage, in-process: the capacity it gives, the model's tokens and logits against
transformers with its keys and values stored as the fp8 cache stores them, each source of the scales (the
checkpoint's tensors as each quantizer names them, 1.0, --calculate-kv-scales), the refusals by name, the C++
layer plan, prefix caching, the planner and the flags serve passes on."""
from __future__ import annotations

import logging
import math

import pytest
import torch

from kernels import cpu_ops
from kv_fp8_cases import fp8_reference, layer_scales, with_tensors
from parity import chained_logits, prompts
from stagemesh.core.errors import StagemeshError
from stage_worker.kv_cache import num_kv_blocks_for_budget
from stage_worker.kv_scales import K_SCALE_CONSTANT, V_SCALE_CONSTANT, as_f32
from stage_worker.runner import StageRunner
from tiny_models import reference_greedy

NEW_TOKENS = 12
CT = {"quant_method": "compressed-tensors"}  # a KV-cache-only compressed-tensors checkpoint


@pytest.fixture(scope="module")
def model64(tiny_model_dir):
    """A tiny llama of head_dim 64: its attention runs on the C++ family kernels (and the layer plan)."""
    return tiny_model_dir("llama", hidden_size=256, num_attention_heads=4, num_key_value_heads=2)


@pytest.mark.parametrize("dtype,ratio", [("bfloat16", 2), ("float32", 4)])
def test_fp8_holds_twice_a_bf16_caches_tokens_in_the_same_memory(model64, dtype, ratio):
    auto = StageRunner.of(model64, 0, 4, dtype=dtype)
    fp8 = StageRunner.of(model64, 0, 4, dtype=dtype, kv_cache_dtype="fp8")
    assert fp8.kv_bytes_per_block * ratio == auto.kv_bytes_per_block
    budget = 64 * 2**20  # --kv-cache-memory
    tokens = [num_kv_blocks_for_budget(budget, r.kv_bytes_per_block) * r.block_size for r in (auto, fp8)]
    assert tokens[1] >= 1.9 * tokens[0]
    fp8.allocate_kv_cache(4)
    assert fp8.kv_caches[0][0].dtype == torch.float8_e4m3fn and fp8.kv_caches[0][0].element_size() == 1


def test_the_start_up_lines_and_metrics_count_the_fp8_cache(model64, caplog):
    """The replica's KV cache size (vLLM's line) and its cache_config_info metric, from the same memory."""
    from prometheus_client import generate_latest

    from stagemesh.entry.local_engine import LocalEngine

    caplog.set_level(logging.INFO, logger="stagemesh.scheduler")
    memory, tokens = 8 * 2**20, {}
    for kv in ("auto", "fp8"):
        caplog.clear()
        with LocalEngine.of(model64, dtype="bfloat16", kv_cache_memory=memory, kv_cache_dtype=kv) as engine:
            blocks = engine.pipeline.plan.num_kv_blocks
            tokens[kv] = blocks * 16
            assert f"KV cache size: {tokens[kv]:,} tokens" in caplog.text
            per_token = 4 * 2 * 2 * 64 * (1 if kv == "fp8" else 2)  # layers x (k, v) x KV heads x head_dim x bytes
            name = "fp8_e4m3" if kv == "fp8" else "auto"
            assert f"KV cache dtype {name} (--kv-cache-dtype): {per_token:,} bytes per token" in caplog.text
            metric = (f'stagemesh:cache_config_info{{block_size="16",cache_dtype="{name}",kv_bytes_per_token='
                      f'"{per_token}",num_gpu_blocks="{blocks}"}} 1.0')
            assert metric in generate_latest().decode()
    assert tokens["fp8"] >= 1.9 * tokens["auto"]


@pytest.mark.parametrize("cache", ["fp8", "fp8_e5m2"])
def test_tokens_and_logits_equal_transformers_reading_the_same_fp8_cache(model64, tmp_path, cache):
    """The checkpoint's scales (llm-compressor's names), every layer's keys and values through the fp8 cache:
    transformers fed the same stored values gives the same greedy tokens, and logits within fp32 rounding but
    for a key that sits on an fp8 rounding boundary: fp32 rounding of the projection and the rotation, which
    differs by machine, may send it to the neighbouring fp8 value, and one such key moves every later
    position's logits a little (7e-3 seen with e4m3 on a Zen 4; within 5e-3 on a Sapphire Rapids). The plain fp32
    model is 50 times further off or more."""
    scales = layer_scales(4, k=0.02, v=0.015)  # calibrated-like: nothing saturates
    ckpt = with_tensors(model64, tmp_path / "m", scales)
    dtype = {"fp8": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}[cache]
    values = [(float(scales[f"model.layers.{i}.self_attn.k_scale"]),
               float(scales[f"model.layers.{i}.self_attn.v_scale"])) for i in range(4)]
    prompt = prompts(384, lengths=(37,))[0]
    tokens, logits = chained_logits(ckpt, [2, 2], prompt, NEW_TOKENS, kv_cache_dtype=cache)
    want_tokens, want_logits = reference_greedy(fp8_reference(model64, values, dtype), prompt, NEW_TOKENS)
    assert tokens == want_tokens
    torch.testing.assert_close(logits, want_logits, atol=1e-2, rtol=1e-3)
    _, fp32_logits = chained_logits(model64, [4], prompt, NEW_TOKENS)
    assert (fp32_logits - want_logits).abs().max() > 50 * (logits - want_logits).abs().max()


def test_checkpoint_scales_under_each_quantizers_names(model64, tmp_path):
    """llm-compressor / AutoFP8 (self_attn.k_scale), ModelOpt (k_proj.k_scale, v_proj.v_scale), compressed-tensors'
    projections' output scales under a kv_cache_scheme, the deprecated single kv_scale (k and v); a stage of
    layers 2:4 reads its own layers' only."""
    want = [(as_f32(0.011 * (1 + i / 10)), as_f32(0.007 * (1 + i / 7))) for i in range(4)]
    scheme = {"quantization_config": {**CT, "kv_cache_scheme": {
        "type": "float", "num_bits": 8, "strategy": "tensor", "dynamic": False, "symmetric": True,
        "observer": "minmax", "group_size": None}}}
    cases = {"llm-compressor": ({}, ("k_scale", "v_scale")), "modelopt": ({}, ("k_proj.k_scale", "v_proj.v_scale")),
             "compressed-tensors": (scheme, ("k_proj.output_scale", "v_proj.output_scale"))}
    for name, (config, names) in cases.items():
        ckpt = with_tensors(model64, tmp_path / name, layer_scales(4, names=names), config)
        runner = StageRunner.of(ckpt, 2, 4, kv_cache_dtype="fp8")
        assert runner.kv_scales.source == "checkpoint" and runner.kv_scales.values() == want[2:], name
        assert [layer.self_attn.kv_scale for layer in runner.model.layers] == runner.kv_scales.layers
    legacy = {f"model.layers.{i}.self_attn.kv_scale": torch.tensor(0.02) for i in range(4)}
    runner = StageRunner.of(with_tensors(model64, tmp_path / "legacy", legacy), 0, 4, kv_cache_dtype="fp8")
    assert runner.kv_scales.values() == [(as_f32(0.02), as_f32(0.02))] * 4
    partial = {k: v for k, v in layer_scales(4).items() if ".1." not in k and ".v_scale" not in k}
    runner = StageRunner.of(with_tensors(model64, tmp_path / "partial", partial), 0, 4, kv_cache_dtype="fp8")
    assert runner.kv_scales.values()[1] == (1.0, 1.0)  # a layer without them: 1.0, as vLLM
    assert runner.kv_scales.values()[0] == (want[0][0], want[0][0])  # a k_scale alone serves v too, as vLLM


def test_no_scales_in_the_checkpoint_is_1_and_auto_reads_but_uses_none(model64, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="stagemesh.stage")
    runner = StageRunner.of(model64, 0, 4, kv_cache_dtype="fp8")
    assert runner.kv_scales.source == "default" and runner.kv_scales.values() == [(1.0, 1.0)] * 4
    assert "KV cache scales of 1.0: the checkpoint has none" in caplog.text
    ckpt = with_tensors(model64, tmp_path / "m", {**layer_scales(4), "model.layers.0.self_attn.q_scale":
                                                  torch.tensor(0.5)})
    auto = StageRunner.of(ckpt, 0, 4)
    assert auto.kv_scales.source == "unused" and auto.kv_caches == [] and auto.kv_cache_dtype == auto.dtype
    assert "KV cache scales (4 layers) are read and unused" in caplog.text
    assert "q_scale / prob_scale tensors are read and unused" in caplog.text


def test_calculated_scales_are_the_first_forwards_max_over_200_and_100(model64):
    """--calculate-kv-scales: after the first step each layer's k_scale is max|K| / 200 and v_scale max|V| / 100
    of that step's keys (rotated) and values: the first layer's those of an fp32 cache (which holds them exactly),
    and in every layer the largest key stored is 200 (192 or 208 in e4m3) and the largest value 100 (96 or 104);
    later steps keep the scales."""
    prompt = prompts(384, lengths=(37,))[0]
    auto = StageRunner.of(model64, 0, 4, dtype="float32")
    fp8 = StageRunner.of(model64, 0, 4, dtype="float32", kv_cache_dtype="fp8", calculate_kv_scales=True)
    assert fp8.kv_scales.pending
    for r in (auto, fp8):
        r.allocate_kv_cache(8)
        r.execute(_prefill(prompt))
    used = lambda c: c.reshape(-1, *c.shape[2:])[:len(prompt)].float()  # noqa: E731  (slots 0..36: blocks 0-2)
    k, v = auto.kv_caches[0]
    assert fp8.kv_scales.source == "calculated"
    assert fp8.kv_scales.values()[0] == (as_f32(float(used(k).abs().max()) / K_SCALE_CONSTANT),
                                         as_f32(float(used(v).abs().max()) / V_SCALE_CONSTANT))
    for k, v in fp8.kv_caches:
        assert float(used(k).abs().max()) in (192, 208) and float(used(v).abs().max()) in (96, 104)
    scales = fp8.kv_scales.values()
    fp8.execute(_decode(prompt, 11))
    assert fp8.kv_scales.values() == scales


def _prefill(prompt):
    from stagemesh.core.sampling_params import SamplingParams
    from stagemesh.core.step import NewSequence, ScheduledChunk, StepBatch

    blocks = list(range(math.ceil(len(prompt) / 16)))
    return StepBatch(0, [NewSequence(0, prompt, SamplingParams(max_tokens=4))],
                     [ScheduledChunk(0, prompt, 0, blocks, True)])


def _decode(prompt, token):
    from stagemesh.core.step import ScheduledChunk, StepBatch

    return StepBatch(1, [], [ScheduledChunk(0, [token], len(prompt), [], True)])


@pytest.mark.parametrize("scales,config,message", [
    ({"model.layers.1.self_attn.k_scale": torch.ones(2), "model.layers.1.self_attn.v_scale": torch.tensor(1.0)}, {},
     r"model.layers.1.self_attn.k_scale: a KV cache scale of shape \[2\]; only per-tensor scales"),
    ({"model.layers.0.self_attn.k_scale": torch.tensor(-0.5)}, {},
     r"model.layers.0.self_attn.k_scale: a KV cache scale of -0.5; a scale must be finite and positive"),
    ({"model.layers.2.self_attn.v_scale": torch.tensor(float("nan")), "model.layers.2.self_attn.k_scale":
      torch.tensor(1.0)}, {}, r"model.layers.2.self_attn.v_scale: a KV cache scale of nan"),
    ({"model.layers.3.self_attn.v_scale": torch.tensor(0.1)}, {},
     r"layer 3 has a v_scale without its k_scale \(model.layers.3.self_attn.k_scale\)"),
    ({"model.layers.0.self_attn.kv_scale": torch.tensor(0.1), "model.layers.0.self_attn.k_scale": torch.tensor(0.1)},
     {}, "layer 0 has both the deprecated kv_scale and k_scale / v_scale"),
    ({"model.layers.0.self_attn.k_scale": torch.tensor(0.1), "model.layers.0.self_attn.k_proj.k_scale":
      torch.tensor(0.1)}, {}, r"layer 0 has two KV cache scales for one tensor"),
    ({}, {"quantization_config": {**CT, "kv_cache_scheme": {"type": "float", "num_bits": 8, "strategy": "channel"}}},
     r"quantization_config.kv_cache_scheme.strategy 'channel' is not built"),
    ({}, {"quantization_config": {**CT, "kv_cache_scheme": {"type": "int", "num_bits": 8, "strategy": "tensor"}}},
     r"quantization_config.kv_cache_scheme.type 'int' is not built"),
    ({}, {"quantization_config": {**CT, "kv_cache_scheme": {"type": "float", "num_bits": 8, "dynamic": True}}},
     r"quantization_config.kv_cache_scheme.dynamic True is not built"),
    ({}, {"quantization_config": {**CT, "kv_cache_scheme": {"type": "float", "num_bits": 8, "group_size": 128}}},
     r"quantization_config.kv_cache_scheme.group_size 128 is not built"),
    ({}, {"quantization_config": {"quant_method": "modelopt", "kv_cache_quant_algo": "FP8"}},
     r"quantization_config \(modelopt\): quant_algo is missing"),
])
def test_scales_the_model_cannot_honour_are_refused_by_name(model64, tmp_path, scales, config, message):
    ckpt = with_tensors(model64, tmp_path / "m", scales, config)
    for dtype in ("fp8", None):  # read and checked whatever the cache's dtype
        with pytest.raises(StagemeshError, match=message):
            StageRunner.of(ckpt, 0, 4, kv_cache_dtype=dtype)


def test_what_is_not_built_is_refused_by_name(model64, tiny_model_dir, capsys):
    import argparse

    from stagemesh.entry.plan.cli import add_arguments, run as plan_run
    from stagemesh.core.flags import parse
    from stage_worker.kv_cache import check_kv_cache_dtype
    from stage_worker.options import StageOptions
    from stagemesh.core.model_config import ModelConfig

    add_arguments(plan_parser := argparse.ArgumentParser())
    with pytest.raises(StagemeshError, match=r"--kv-cache-dtype 'fp4' is not built; stagemesh has auto, fp8, "):
        StageRunner.of(model64, 0, 4, kv_cache_dtype="fp4")
    with pytest.raises(SystemExit):
        parse(StageOptions, ["--scheduler", "x:1", "--stage-index", "0", "--kv-cache-dtype", "int8"])
    assert "argument --kv-cache-dtype: invalid choice: 'int8'" in capsys.readouterr().err
    with pytest.raises(StagemeshError, match="--calculate-kv-scales sets an fp8 KV cache's scales: it needs "):
        StageRunner.of(model64, 0, 4, calculate_kv_scales=True)
    mla = ModelConfig.from_path(tiny_model_dir("deepseek_v3"))
    with pytest.raises(StagemeshError, match="with multi-head latent attention .* is not built yet"):
        check_kv_cache_dtype("fp8", mla)
    with pytest.raises(StagemeshError, match="with multi-head latent attention .* is not built yet"):
        plan_run(plan_parser.parse_args([str(tiny_model_dir("deepseek_v3")), "--kv-cache-dtype", "fp8"]))
    check_kv_cache_dtype("auto", mla)
    runner = StageRunner.of(model64, 0, 4, kv_cache_dtype="fp8")
    with pytest.raises(StagemeshError, match="draft model does not run with an fp8 KV cache yet"):
        runner.attach_drafter(object())


def test_a_scheduler_refuses_a_stage_of_another_kv_cache_dtype():
    from scheduler.rendezvous import ModelIdentity, Rendezvous, StageInfo

    model = ModelIdentity("llama", 4, 64, 384, 4, 2)
    rendezvous = Rendezvous(1, 16, model, kv_cache_dtype="fp8")
    stage = StageInfo(0, 0, 4, 1, "cpu", 10, 16, model, "a:1", "grpc", kv_cache_dtype="auto")
    with pytest.raises(StagemeshError, match=r"uses --kv-cache-dtype auto; the scheduler uses fp8_e4m3"):
        rendezvous.register(stage)
    rendezvous.register(StageInfo(0, 0, 4, 1, "cpu", 10, 16, model, "a:1", "grpc", kv_cache_dtype="fp8_e4m3"))


@pytest.mark.skipif(cpu_ops.load() is None, reason="the CPU kernels could not be built here")
def test_the_cpp_layer_plan_runs_over_an_fp8_cache_as_the_python_layer(model64):
    """The plan (stage_worker.layer_plan) over an fp8 cache makes the Python layer's kernel calls with the layer's
    scales: the same bits; a first forward that calculates the scales runs the Python layer."""
    from stage_worker import layer_plan

    prompt = prompts(384, lengths=(21,))[0]
    outs = []
    for plan_on in (True, False):
        layer_plan.enable(plan_on)
        try:
            runner = StageRunner.of(model64, 0, 4, kv_cache_dtype="fp8", calculate_kv_scales=True)
            runner.allocate_kv_cache(4)
            runner.execute(_prefill(prompt))
            hidden = runner.execute(_decode(prompt, 9), return_logits=True).logits
            layer = runner.model.layers[0]
            if plan_on:
                plan = layer.__dict__["_plan"]
                assert plan.cpp is not None and plan.runs(torch.zeros(1, 256), runner.kv_caches[0])
            outs.append(hidden)
        finally:
            layer_plan.enable(True)
    assert torch.equal(outs[0], outs[1])


def test_prefix_caching_reuses_fp8_blocks_token_for_token(model64):
    from stagemesh.core.sampling_params import SamplingParams
    from stagemesh.entry.local_engine import LocalEngine

    prompt = prompts(384, lengths=(70,))[0]
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    with LocalEngine.of(model64, kv_cache_dtype="fp8", calculate_kv_scales=True) as engine:
        first = engine.generate([prompt], greedy)
        again = engine.generate([prompt], greedy)
        assert engine.stats().prefix_cache_hits >= 64 and again == first
    with LocalEngine.of(model64, kv_cache_dtype="fp8", calculate_kv_scales=True, enable_prefix_caching=False) as engine:
        assert engine.generate([prompt], greedy) == first


def test_the_plan_counts_an_fp8_cache(tmp_path):
    from stagemesh.entry.plan.render import as_json
    from stagemesh.entry.plan.cli import load_config, parse_bytes
    from stagemesh.entry.plan.tree import PlanRequest, make_plan

    cfg, model = load_config("Llama-3.1-70B")
    plans = {}
    for kv in ("auto", "fp8"):
        req = PlanRequest(cfg, 8, 1, parse_bytes("80GiB"), "bf16", 32768, tensor_parallel_size=8, kv_cache_dtype=kv)
        plans[kv] = as_json(req, make_plan(req), model, "cuda")
    assert plans["fp8"]["kv_cache_tokens"] >= 1.9 * plans["auto"]["kv_cache_tokens"]
    assert plans["fp8"]["kv_bytes_per_token"] * 2 == plans["auto"]["kv_bytes_per_token"]
    assert "--kv-cache-dtype fp8" in plans["fp8"]["commands"]["serve"]
    assert "--kv-cache-dtype" not in plans["auto"]["commands"]["serve"]


def test_serve_passes_the_kv_cache_flags_to_its_schedulers_and_stages():
    import argparse

    from stagemesh.entry.serve import add_arguments, plan_commands

    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["-pp", "2", "--kv-cache-dtype", "fp8_e5m2", "--calculate-kv-scales"])
    children = {c.name: c.argv for c in plan_commands(args, "/m", 4, cuda=False)}
    for name in ("scheduler[0]", "stage[0.0]", "stage[0.1]"):
        argv = children[name]
        assert argv[argv.index("--kv-cache-dtype") + 1] == "fp8_e5m2", name
    assert "--calculate-kv-scales" in children["stage[0.1]"] and "--calculate-kv-scales" not in children["scheduler[0]"]
    assert "--kv-cache-dtype" not in children["router"]
