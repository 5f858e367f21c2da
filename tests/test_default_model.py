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


def test_the_converted_model_asks_for_greedy_decoding_and_an_older_cache_gets_it(tmp_path, monkeypatch):
    """The GGUF carries no sampling: the conversion writes the generation_config.json the router reads
    (stagemesh.core.default_model.EMBEDDED_SAMPLING says why greedy), and adds it to a cache converted before."""
    target = tmp_path / "models" / DEFAULT_MODEL_NAME
    target.mkdir(parents=True)
    (target / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"],
                                                    "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}))
    (target / ".complete").write_text("old\n")
    monkeypatch.setenv("STAGEMESH_CACHE", str(tmp_path))
    assert default_model_dir() == target
    written = json.loads((target / "generation_config.json").read_text())
    assert written == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2, "do_sample": False,
                       "temperature": 0.0}
