"""A stage's settings (stage_worker.settings) cross whole: from `stagemesh stage`'s flags, unrenamed, to the
runner and over a follower's pipe (JSON), with nothing lost on the way."""
from __future__ import annotations

import dataclasses
import os
from types import SimpleNamespace

import pytest

from stage_worker import control
from stage_worker.follower import read_start, start_message
from stage_worker.options import StageOptions
from stage_worker.runner import StageRunner
from stage_worker.settings import RESOLVED, StageSettings
from stagemesh.core.flags import GROUP, flags, parse

ARGV = ["--scheduler", "h:1", "--stage-index", "1", "-tp", "2", "--dtype", "float32", "--block-size", "32",
        "--enforce-eager", "--kv-cache-dtype", "fp8", "--calculate-kv-scales", "--enable-lora", "--lora-modules",
        "a=/adapters/a", "--max-loras", "3", "--runner", "pooling", "--threads", "2", "--enable-expert-parallel",
        "--enable-eplb", "--eplb-config", '{"window_size": 7}', "-pcp", "2", "--device", "cuda"]


def test_every_setting_is_the_stage_flag_of_its_name():
    stage_flags = dict(flags(StageOptions))
    for f in dataclasses.fields(StageSettings):
        if f.name in RESOLVED:  # (what the model's source and the layers resolve to)
            continue
        names = [n for n, _ in flags(f.metadata[GROUP])] if GROUP in f.metadata else [f.name]
        assert all(n in stage_flags for n in names), f.name


def test_the_flags_give_the_settings_unrenamed():
    options = parse(StageOptions, ARGV)
    args = SimpleNamespace(**{name: _value(options, name) for name, _ in flags(StageOptions)})
    source = SimpleNamespace(model_dir="/models/m", gguf_file=None, quantization="w8a16", activations="exact")
    s = StageSettings.from_flags(args, source, (2, 4))
    assert (s.tensor_parallel_size, s.prefill_context_parallel_size, s.block_size, s.dtype) == (2, 2, 32, "float32")
    assert s.enforce_eager and s.calculate_kv_scales and s.enable_expert_parallel and s.enable_eplb
    assert (s.kv_cache_dtype, s.eplb_config, s.threads, s.device) == ("fp8", '{"window_size": 7}', 2, "cuda")
    assert s.lora.enable_lora and s.lora.lora_modules == ("a=/adapters/a",) and s.lora.max_loras == 3
    assert s.pooling.runner == "pooling" and s.layers == (2, 4) and s.ranks == 4
    assert (s.model_dir, s.gguf_file, s.quantization, s.quantization_activations) == ("/models/m", None, "w8a16",
                                                                                       "exact")


def test_a_gguf_model_is_its_file_and_its_config_directory():
    source = SimpleNamespace(model_dir="/models/m", gguf_file="/w/m.gguf", quantization="gguf", activations=None)
    s = StageSettings.from_flags(SimpleNamespace(**{n: f.default for n, f in flags(StageOptions)}), source, (0, 4))
    assert (s.model, s.tokenizer, s.model_dir, s.gguf_file) == ("/w/m.gguf", "/models/m", "/models/m", "/w/m.gguf")


def test_the_settings_cross_a_followers_pipe_whole():
    settings = StageSettings.of("/models/m", 2, 4, tensor_parallel_size=2, enable_lora=True,
                                lora_modules=["a=/adapters/a"], max_cpu_loras=2, runner="pooling",
                                pooler_config='{"normalize": false}', kv_cache_dtype="fp8", enforce_eager=True)
    read, write = os.pipe()
    try:
        os.write(write, start_message(settings, 1, ("/disk/ns-dir", "ns")))
        got, rank, disk = read_start(control.Reader(read))
    finally:
        os.close(read)
        os.close(write)
    assert got == settings and rank == 1 and disk == ("/disk/ns-dir", "ns")


def test_a_follower_refuses_a_pipe_that_does_not_start_with_its_settings():
    read, write = os.pipe()
    try:
        os.write(write, control.frame(control.JOIN, 0, b""))
        with pytest.raises(SystemExit, match="START"):
            read_start(control.Reader(read))
    finally:
        os.close(read)
        os.close(write)


def test_a_runner_takes_its_settings_whole(tiny_model_dir):
    settings = StageSettings.of(tiny_model_dir("llama"), 0, 2, dtype="float32", block_size=8, kv_cache_dtype="fp8")
    runner = StageRunner(settings)
    assert runner.settings is settings and runner.block_size == 8
    assert str(runner.kv_cache_dtype) == "torch.float8_e4m3fn"
    assert len(runner.model.layers) == 2


def _value(options, name: str):
    """A flag's value in parsed options, nested groups' too."""
    for f in dataclasses.fields(options):
        value = getattr(options, f.name)
        if f.name == name:
            return value
        if GROUP in f.metadata and name in {n for n, _ in flags(f.metadata[GROUP])}:
            return _value(value, name)
    raise KeyError(name)
