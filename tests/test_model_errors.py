"""Bad model input gets one clear line, never a traceback."""
from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from stagemesh.core.errors import StagemeshError
from stagemesh.core.families import SUPPORTED_MODEL_TYPES
from stage_worker.runner import StageRunner
from mesh import run_stagemesh


def stagemesh(*args: str) -> subprocess.CompletedProcess:
    return run_stagemesh([*args], timeout=120)


def test_directory_that_is_not_a_model(tmp_path):
    result = stagemesh("generate", str(tmp_path))
    assert result.returncode == 2
    assert result.stderr.strip() == f"stagemesh generate: error: {tmp_path} is not a model: it has no config.json"


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    result = stagemesh("generate", str(tmp_path))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert (f"unsupported architecture GPT2LMHeadModel (model_type 'gpt2'); supported: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}" in result.stderr)  # from the family registry
    assert "llama, mistral" in result.stderr and "mixtral, qwen2_moe, qwen3_moe" in result.stderr


@pytest.mark.parametrize("change,message", [
    ({"num_experts_per_tok": 9}, "num_experts_per_tok 9 must be between 1 and the model's 8 experts"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
])
def test_mixture_of_experts_config_that_cannot_be_served(tmp_path, change, message):
    config = (Path(__file__).parents[1] / "stagemesh" / "entry" / "plan" / "reference_configs" / "Mixtral-8x7B.json")
    (tmp_path / "config.json").write_text(json.dumps({**json.loads(config.read_text()), **change}))
    result = stagemesh("generate", str(tmp_path))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert message in result.stderr


def test_layer_range_outside_the_model(tiny_model_dir):
    with pytest.raises(StagemeshError, match=r"layer range 2:9 is outside the model's 4 layers"):
        StageRunner.of(tiny_model_dir("llama"), 2, 9)


def test_missing_weights(tmp_path, tiny_model_dir):
    (tmp_path / "config.json").write_text((tiny_model_dir("llama") / "config.json").read_text())
    with pytest.raises(StagemeshError, match="has no \\*.safetensors weights"):
        StageRunner.of(tmp_path, 0, 4)


@pytest.mark.slow
def test_default_model_names_paris():
    result = stagemesh("generate", "--prompt", "What is the capital of France?", "--max-tokens", "24")
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout


@pytest.mark.parametrize("argv, want", [
    (["--stage-index", "1", "--layers", "3:7"], (3, 7)),
    (["--stage-index", "0", "--pipeline-parallel-size", "3"], (0, 4)),  # 10 layers: 4, 3, 3
    (["--stage-index", "2", "-pp", "3"], (7, 10)),
    (["--stage-index", "1", "-pp", "3", "--layer-split", "2,5,3"], (2, 7)),
])
def test_a_stage_takes_its_layers_or_its_share_of_the_split(argv, want):
    from stagemesh.entry.cli import build_parser
    from stage_worker.cli import stage_layers

    args = build_parser(only="stage").parse_args(["stage", "--scheduler", "h:1", *argv])
    assert stage_layers(args, 10) == want


@pytest.mark.parametrize("argv, message", [
    (["--stage-index", "0"], "give the stage's layers: --layers A:B, or --pipeline-parallel-size"),
    (["--stage-index", "0", "--layers", "0:5", "-pp", "2"], "either --layers or --pipeline-parallel-size"),
    (["--stage-index", "3", "-pp", "3"], "--stage-index 3 is out of range for --pipeline-parallel-size 3"),
    (["--stage-index", "0", "-pp", "2", "--layer-split", "4,4"], "summing to the model's 10 layers"),
])
def test_a_stage_without_a_usable_layer_range_is_refused(argv, message):
    from stagemesh.entry.cli import build_parser
    from stage_worker.cli import stage_layers

    args = build_parser(only="stage").parse_args(["stage", "--scheduler", "h:1", *argv])
    with pytest.raises(StagemeshError, match=re.escape(message)):
        stage_layers(args, 10)
