"""--quantization on CUDA stages (kernels/triton_quant.py, weight-only): a stage of w8a16 or fp8 weights, or of
a GGUF's, gives transformers' greedy tokens and logits on the same weights dequantised, CUDA graphs and all
(needs a GPU); what is not built is refused by name (anywhere)."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from kernels import quant_reference as qref
from stage_worker.quantization import check_quantization
from stagemesh.core.errors import StagemeshError
from stagemesh.core.model_config import ModelConfig

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA stages need an NVIDIA GPU")
LINEARS = tuple(f"{p}.weight" for p in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))
PROMPTS = [[5, 9, 3], [7] * 11, [2, 4, 6, 8, 10, 12, 1], [3] * 20, [1, 2]]


def test_what_is_not_built_is_refused_by_name(tiny_model_dir):
    cfg = ModelConfig.from_path(tiny_model_dir("llama"))
    with pytest.raises(StagemeshError, match="w8a8 .*built for CPU stages only"):
        check_quantization("w8a8", cfg, "cuda")
    with pytest.raises(StagemeshError, match="fp8 is built for CUDA stages only"):
        check_quantization("fp8", cfg, "cpu")
    with pytest.raises(StagemeshError, match="'int4' is not built"):
        check_quantization("int4", cfg, "cuda")
    for method in ("w8a16", "fp8", "gguf"):
        check_quantization(method, cfg, "cuda")


def dequantised_dir(model_dir: Path, out: Path, method: str) -> Path:
    """model_dir with each linear weight quantised as a stage does at load, then dequantised: the reference."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(model_dir, out, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    state = {}
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        state.update(load_file(file))
    quantise = qref.quantize_fp8_per_channel if method == "fp8" else qref.quantize_int8_per_channel
    for name, tensor in state.items():
        if name.endswith(LINEARS):
            state[name] = qref.dequantize(*quantise(tensor), None)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def check_against(reference_dir: Path, runner) -> None:
    from test_cuda_graphs import decode
    from tiny_models import reference_greedy, reference_model

    steps = 12
    tokens, logits = decode(runner, PROMPTS, steps)
    assert runner.graphs is not None  # the decode steps replayed CUDA graphs around the Triton products
    reference = reference_model(reference_dir)
    for i, prompt in enumerate(PROMPTS):
        want_tokens, want_logits = reference_greedy(reference, prompt, steps + 1)
        assert tokens[i] == want_tokens
        torch.testing.assert_close(logits[:, i].float().cpu(), want_logits[1:], atol=5e-4, rtol=1e-4)


@needs_cuda
@pytest.mark.parametrize("method", ["w8a16", "fp8"])
def test_quantised_at_load_is_the_dequantised_model(tiny_model_dir, tmp_path, method):
    from stage_worker.quant_weight import QuantizedWeight
    from stage_worker.runner import StageRunner

    model = tiny_model_dir("llama")
    runner = StageRunner.of(model, 0, 4, device="cuda", dtype=torch.float32, quantization=method, max_graph_batch=16)
    held = [m for m in runner.model.modules() if isinstance(m, QuantizedWeight)]
    assert len(held) == 4 * 4 and all(m.qs.is_cuda for m in held)  # qkv, o, gate_up, down of 4 layers
    assert {m.qs.dtype for m in held} == {torch.float8_e4m3fn if method == "fp8" else torch.int8}
    check_against(dequantised_dir(model, tmp_path / "dequantised", method), runner)


@needs_cuda
@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q4_K", "Q8_0"])
def test_gguf_on_cuda_is_transformers_on_its_dequantised_weights(tiny_model_dir, tmp_path, qtype):
    pytest.importorskip("gguf")
    from gguf_models import dequantised_model_dir, write_gguf
    from stage_worker.runner import StageRunner

    # Q4_K's super-blocks are 256 wide: a tiny model with 256 hidden, 512 intermediate
    model = tiny_model_dir("llama", **({"hidden_size": 256, "intermediate_size": 512} if qtype == "Q4_K" else {}))
    path = write_gguf(model, tmp_path / "tiny.gguf", qtype)
    runner = StageRunner.of(model, 0, 4, device="cuda", dtype=torch.float32, gguf_file=str(path), max_graph_batch=16)
    check_against(dequantised_model_dir(model, path, tmp_path / "dequantised"), runner)
