"""GGUF weights served as they are: the file's blocks re-laid exactly, a TP shard's slices, and the tiny
models' GGUFs (every format) giving transformers' greedy tokens on the same weights dequantised."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from gguf_models import dequantised_model_dir, quantize_q4_k, write_gguf
from kernels.quant_reference import dequantize
from parity import chained_logits, prompts
from stagemesh.entry.local_engine import LocalEngine
from stagemesh.core.errors import StagemeshError
from stagemesh.core.model_config import ModelConfig
from stagemesh.core.sampling_params import SamplingParams
from stage_worker.gguf import GGUFCheckpoint
from stage_worker.runner import StageRunner
from tiny_models import reference_greedy, reference_model, reference_tokens

FORMATS = ("Q4_0", "Q4_1", "Q4_K", "Q8_0")


@pytest.fixture(scope="module")
def tiny_gguf(tiny_model_dir, tmp_path_factory):
    """Factory: (config dir, .gguf, dequantised reference dir) of a tiny llama in `qtype`, cached."""
    cache = {}

    def make(qtype: str):
        if qtype not in cache:
            # Q4_K's super-blocks are 256 wide: a tiny model with 256 hidden, 512 intermediate
            model_dir = tiny_model_dir("llama", **({"hidden_size": 256, "intermediate_size": 512}
                                                   if qtype == "Q4_K" else {}))
            tmp = tmp_path_factory.mktemp(f"gguf-{qtype}")
            path = write_gguf(model_dir, tmp / f"tiny-{qtype}.gguf", qtype, embed_qtype="Q8_0")
            cache[qtype] = (model_dir, path, dequantised_model_dir(model_dir, path, tmp / "dequantised"))
        return cache[qtype]

    return make


def test_q4_k_quantiser_against_gguf_dequantiser():
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    x = np.random.default_rng(0).normal(size=(6, 512)).astype(np.float32)
    back = gguf_dequantize(quantize_q4_k(x), GGMLQuantizationType.Q4_K)
    spread = x.reshape(-1, 32).max(-1) - np.minimum(x.reshape(-1, 32).min(-1), 0)
    assert np.all(np.abs(back - x).reshape(-1, 32).max(-1) <= spread / 15)  # within a step of its sub-block


@pytest.mark.parametrize("qtype", FORMATS)
def test_blocks_are_relaid_exactly(tiny_gguf, qtype):
    """Every quantised tensor read whole (q and k un-permuted) dequantises to gguf's numbers."""
    model_dir, path, reference_dir = tiny_gguf(qtype)
    from safetensors.torch import load_file

    want = load_file(reference_dir / "model.safetensors")
    ckpt = GGUFCheckpoint(path, ModelConfig.from_path(model_dir))
    for name in ("model.layers.1.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
                 "model.layers.2.mlp.down_proj.weight", "model.embed_tokens.weight"):
        rows = ckpt.shape(name)[0]
        qs, scales, mins = ckpt.read_quantised(name, 0, 0, rows)
        assert torch.equal(dequantize(qs, scales, mins), want[name]), name


@pytest.mark.parametrize("qtype", ["Q4_1", "Q4_K", "Q8_0"])
def test_tp_shards_read_only_their_slices_and_refuse_split_blocks(tiny_gguf, qtype):
    model_dir, path, _ = tiny_gguf(qtype)
    ckpt = GGUFCheckpoint(path, ModelConfig.from_path(model_dir))
    name = "model.layers.0.mlp.down_proj.weight"
    rows, cols = ckpt.shape(name)
    whole = dequantize(*ckpt.read_quantised(name, 0, 0, rows))
    for start in range(0, cols, 64):  # row-parallel: columns in whole blocks of 32
        torch.testing.assert_close(dequantize(*ckpt.read_quantised(name, 1, start, 64)), whole[:, start:start + 64],
                                   rtol=0, atol=0)
    torch.testing.assert_close(dequantize(*ckpt.read_quantised(name, 0, 3, 5)), whole[3:8], rtol=0, atol=0)
    with pytest.raises(StagemeshError, match="would split a quantisation block of 32"):
        ckpt.read_quantised(name, 1, 16, 32)


@pytest.mark.parametrize("qtype", FORMATS)
def test_gguf_model_gives_transformers_greedy_tokens(tiny_gguf, qtype):
    """The GGUF served as it is (exact dequantisation in the products) = transformers on the dequantised
    weights: same greedy tokens, logits within fp32 tolerance."""
    model_dir, path, reference_dir = tiny_gguf(qtype)
    reference = reference_model(reference_dir)
    vocab = ModelConfig.from_path(model_dir).vocab_size
    cases = prompts(vocab, lengths=(5, 37, 12))
    with LocalEngine.of(model_dir, layer_split=[2, 2], quantization="gguf", gguf_file=str(path)) as engine:
        got = engine.generate(cases, SamplingParams(max_tokens=8, ignore_eos=True))
    for prompt, tokens in zip(cases, got):
        assert tokens == reference_tokens(reference, prompt, 8)
    tokens, logits = chained_logits(model_dir, [1, 3], cases[1], 6, quantization="gguf", gguf_file=str(path))
    want_tokens, want_logits = reference_greedy(reference, cases[1], 6)
    assert tokens == want_tokens
    torch.testing.assert_close(logits, want_logits, atol=2e-4, rtol=1e-4)


def test_tp_size_that_splits_a_block_is_refused(tiny_gguf):
    """TP=4 on the tiny llama gives o_proj 16 input columns a rank: half a Q4_1 block."""
    model_dir, path, _ = tiny_gguf("Q4_1")
    with pytest.raises(StagemeshError, match="would split a quantisation block of 32"):
        StageRunner.of(model_dir, 0, 1, tp_rank=1, tensor_parallel_size=4, quantization="gguf", gguf_file=str(path))


def test_a_gguf_of_another_architecture_or_shape_is_refused(tiny_gguf, tiny_model_dir):
    model_dir, path, _ = tiny_gguf("Q4_1")
    with pytest.raises(StagemeshError, match="holds a 'llama' model and the config a qwen2"):
        GGUFCheckpoint(path, ModelConfig.from_path(tiny_model_dir("qwen2")))
    wider = tiny_model_dir("llama", intermediate_size=160)
    with pytest.raises(StagemeshError, match="blk.0.ffn_gate.weight has 128 rows; the shard wants 0:160"):
        StageRunner.of(wider, 0, 1, quantization="gguf", gguf_file=str(path))


def test_model_sources_and_refusals(tiny_gguf, tiny_model_dir):
    """What a MODEL argument with --tokenizer / --quantization names, and the combinations refused by name."""
    from stagemesh.core.default_model import DEFAULT_MODEL_NAME, gguf_path
    from stagemesh.core.model_source import resolve_source
    from stage_worker.quantization import check_quantization

    model_dir, path, _ = tiny_gguf("Q4_1")
    src = resolve_source(str(path), str(model_dir))
    assert (src.model_dir, src.gguf_file, src.quantization, src.name) == (model_dir, path, "gguf", str(path))
    assert src.stage_args() == [str(path), "--tokenizer", str(model_dir), "--quantization", "gguf"]
    embedded = resolve_source(None, None, "gguf")
    assert embedded.gguf_file == gguf_path() and embedded.name == DEFAULT_MODEL_NAME
    assert resolve_source(str(model_dir), None, "w8a8").stage_args() == [str(model_dir), "--quantization", "w8a8"]
    for args, match in [((str(path),), "give --tokenizer DIR"),
                        ((str(model_dir), None, "gguf"), "--quantization gguf needs a .gguf file"),
                        ((str(path), str(model_dir), "w8a16"), "--quantization w8a16 takes an fp32/bf16 model"),
                        ((str(model_dir), str(model_dir)), "--tokenizer goes with a .gguf model")]:
        with pytest.raises(StagemeshError, match=match):
            resolve_source(*args)
    with pytest.raises(StagemeshError, match="with a mixture-of-experts model \\(mixtral\\) is not built"):
        check_quantization("w8a8", ModelConfig.from_path(tiny_model_dir("mixtral")), "cpu")
