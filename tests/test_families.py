"""The model-family registry (stagemesh.core.families) is the one place that knows families: no code outside it
tests a model_type, and what a family declares of its tensors is what transformers' checkpoints hold."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
from stagemesh.core.families import FAMILIES, SUPPORTED_MODEL_TYPES
from stagemesh.core.model_config import ModelConfig
from tiny_models import ARCHS, MOE_ARCHS, tiny_config

ROOT = Path(__file__).parents[1]
PACKAGES = ("stagemesh", "scheduler", "stage_worker", "router", "kernels")
REGISTRY = ROOT / "stagemesh" / "core" / "families"


def test_no_family_is_named_outside_the_registry():
    """A string naming a family (a model_type) outside stagemesh/core/families is a family test in disguise.
    vLLM's reasoning parser names (router/reasoning.py) are not families, though one is spelled as one (qwen3)."""
    from router.reasoning import REASONING_PARSERS

    found = []
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            if REGISTRY in path.parents or path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
                continue
            parsers = REASONING_PARSERS if path == ROOT / "router" / "reasoning.py" else ()
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Constant) and node.value in FAMILIES and node.value not in parsers:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.value!r}")
    assert not found, found


def test_the_registry_holds_the_served_families():
    assert set(SUPPORTED_MODEL_TYPES) == set(FAMILIES) >= {
        "llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe", "phi3"}
    assert all(FAMILIES[t].experts is None for t in SUPPORTED_MODEL_TYPES[:5])  # dense first, then MoE


def assert_layer_shapes_match(model_dir: Path) -> None:
    """What the family declares of each kind of layer (the planner counts it) is what the checkpoint holds."""
    from safetensors import safe_open

    held = {}
    for file in model_dir.glob("*.safetensors"):
        with safe_open(file, framework="pt") as f:
            held.update({name: tuple(f.get_slice(name).get_shape()) for name in f.keys()})
    cfg = ModelConfig.from_path(model_dir)
    for index in range(cfg.num_hidden_layers):
        prefix = f"model.layers.{index}."
        want = {name: shape for name, shape in held.items() if name.startswith(prefix)}
        assert cfg.family.layer_shapes(cfg, index, cfg.is_sparse_layer(index)) == want, index


@pytest.mark.parametrize("arch,overrides", [(arch, {}) for arch in ARCHS + MOE_ARCHS] + [
    ("qwen2_moe", {"mlp_only_layers": [1], "qkv_bias": False})])
def test_declared_layer_shapes_are_the_checkpoints(tiny_model_dir, arch, overrides):
    assert_layer_shapes_match(tiny_model_dir(arch, **overrides))


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_moe"])
def test_an_o_proj_bias_is_refused_by_name(arch):
    """Their attention_bias biases o_proj too, which the stage does not add: refused, never silently dropped."""
    from stagemesh.core.errors import StagemeshError

    raw = tiny_config(arch, attention_bias=True).to_dict()
    with pytest.raises(StagemeshError, match=rf"{arch}: attention_bias \(biases on q, k, v and o_proj\) is not"):
        ModelConfig.from_dict(raw)
    assert not ModelConfig.from_dict({**raw, "attention_bias": False}).attention_bias
