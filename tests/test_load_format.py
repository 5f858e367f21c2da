"""--load-format (vLLM's): dummy serves a model from its config.json alone, with vLLM's seeded uniform weights,
the same on every run; a format that does not fit the model, or dummy with quantization, is refused by name."""
from __future__ import annotations

import shutil

import pytest
import torch

from stage_worker.options import StageOptions
from stage_worker.runner import StageRunner
from stagemesh.core.errors import StagemeshError
from stagemesh.core.flags import parse
from stagemesh.core.sampling_params import SamplingParams
from stagemesh.entry.local_engine import LocalEngine


@pytest.fixture
def config_only(tiny_model_dir, tmp_path):
    """A model directory with its config.json and no weights."""
    shutil.copy(tiny_model_dir("llama") / "config.json", tmp_path / "config.json")
    return tmp_path


def test_dummy_weights_serve_a_model_with_no_checkpoint_the_same_on_every_run(config_only):
    sampling = SamplingParams(max_tokens=6, ignore_eos=True)
    runs = []
    for _ in range(2):
        with LocalEngine.of(config_only, layer_split=[1, 3], load_format="dummy", dtype="float32") as engine:
            runs.append(engine.generate([[5, 9, 2, 7]], sampling))
    assert len(runs[0][0]) == 6 and runs[0] == runs[1]
    runner = StageRunner.of(config_only, 0, 4, load_format="dummy", dtype="float32")
    weights = [p.to_dense() if p.is_mkldnn else p for p in runner.model.parameters()]  # (CPU-packed linears)
    assert all(p.abs().max() <= 1e-3 for p in weights) and all(p.abs().max() > 0 for p in weights)


def test_without_dummy_a_model_with_no_weights_is_refused(config_only):
    with pytest.raises(StagemeshError, match=r"no \*\.safetensors weights"):
        StageRunner.of(config_only, 0, 4)


def test_a_format_that_does_not_fit_the_model_is_refused_by_name(tiny_model_dir):
    with pytest.raises(StagemeshError, match=r"--load-format gguf does not read .* \(a safetensors checkpoint"):
        StageRunner.of(tiny_model_dir("llama"), 0, 4, load_format="gguf")
    runner = StageRunner.of(tiny_model_dir("llama"), 0, 4, load_format="safetensors", dtype="float32")
    checkpoint = StageRunner.of(tiny_model_dir("llama"), 0, 4, dtype="float32")
    assert torch.equal(runner.model.embed_tokens.weight, checkpoint.model.embed_tokens.weight)


def test_dummy_with_quantization_is_refused(config_only):
    with pytest.raises(StagemeshError, match="--load-format dummy with quantization w8a16 is not built yet"):
        StageRunner.of(config_only, 0, 4, load_format="dummy", quantization="w8a16")


def test_the_stage_takes_the_flag_and_refuses_a_format_it_does_not_read():
    stage = ["--scheduler", "h:1", "--stage-index", "0"]
    assert parse(StageOptions, [*stage, "--load-format", "dummy"]).settings.load_format == "dummy"
    with pytest.raises(SystemExit):
        parse(StageOptions, [*stage, "--load-format", "pt"])


def test_dummy_with_a_draft_model_is_refused_before_the_draft_reads_its_checkpoint(config_only, tiny_model_dir):
    spec = f'{{"model": "{tiny_model_dir("llama")}", "num_speculative_tokens": 2}}'
    with pytest.raises(StagemeshError, match="--load-format dummy with a drafting --speculative-config .* not built"):
        LocalEngine.of(config_only, load_format="dummy", dtype="float32", speculative_config=spec)
