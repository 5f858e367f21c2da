"""The embedded default model's converted directory names its architecture (other servers, vLLM's among
them, need it), and a cache converted by an earlier version without it is fixed on first use."""
from __future__ import annotations

import json

from stagemesh.core.default_model import DEFAULT_MODEL_NAME, default_model_dir


def test_the_converted_default_model_names_its_architecture(default_model_dir):
    assert json.loads((default_model_dir / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]


def test_an_older_cache_without_architectures_is_fixed(tmp_path, monkeypatch):
    target = tmp_path / "models" / DEFAULT_MODEL_NAME
    target.mkdir(parents=True)
    (target / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": None}))
    (target / ".complete").write_text("old\n")
    monkeypatch.setenv("STAGEMESH_CACHE", str(tmp_path))
    assert default_model_dir() == target
    config = json.loads((target / "config.json").read_text())
    assert config == {"model_type": "llama", "architectures": ["LlamaForCausalLM"]}
