"""Tensor parallelism over real gloo processes matches transformers; shards hold only their part."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from parity import prompts
from stagemesh.core.errors import StagemeshError
from stagemesh.core.model_config import ModelConfig
from stage_worker.runner import StageRunner
from mesh import START_METHOD, exit_codes, free_port
from stagemesh.entry.forkserver import spawn_stagemesh
from tiny_models import make_tiny_model, reference_greedy, reference_model

WORKER = Path(__file__).with_name("tp_worker.py")


def slow_case(case: tuple) -> object:
    """A case `make test` runs and `make test-fast` leaves out."""
    return pytest.param(*case, marks=pytest.mark.slow)


def run_tp(model_dir, world: int, split: str, prompt: list[int], new_tokens: int, tmp_path,
           expert_parallel: bool = False, *extra: str, env: dict | None = None) -> dict:
    out = tmp_path / "result.json"
    port = free_port()
    procs = [spawn_stagemesh(["--model", str(model_dir), "--rank", str(r), "--world", str(world), "--port", str(port),
                              "--split", split, "--prompt", ",".join(map(str, prompt)), "--new-tokens",
                              str(new_tokens), "--out", str(out), *(["--expert-parallel"] if expert_parallel else []),
                              *extra], env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}, script=str(WORKER),
                             start_method=START_METHOD)
             for r in range(world)]
    codes = exit_codes(procs)
    assert codes == [0] * world
    return json.loads(out.read_text())


@pytest.mark.parametrize("arch,overrides,split", [
    ("llama", {}, "2,2"),                           # KV heads split over ranks
    ("llama", {"num_key_value_heads": 1}, "1,3"),   # MQA: the KV head is replicated
    ("qwen2", {}, "4"),                             # QKV bias shards
    ("qwen3", {"tie_word_embeddings": True}, "3,1"),  # q/k norm, tied vocab-parallel head
])
def test_tp2_matches_transformers(tiny_model_dir, tmp_path, arch, overrides, split):
    model_dir = tiny_model_dir(arch, **overrides)
    prompt = prompts(384, lengths=(37,))[0]
    want_tokens, want_logits = reference_greedy(reference_model(model_dir), prompt, 32)
    got = run_tp(model_dir, 2, split, prompt, 32, tmp_path)
    assert got["tokens"] == want_tokens
    torch.testing.assert_close(torch.tensor(got["logits"]), want_logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch,overrides,world,flag,size,chunk", [
    # DCP: the KV heads a DCP group's ranks share (as if TP were world / size), each half of every block's tokens
    # MQA: DCP splits the tokens TP would replicate
    slow_case(("llama", {"num_key_value_heads": 1}, 2, "--dcp", 2, 16)),
    ("llama", {}, 2, "--dcp", 2, 5),  # both KV heads on each rank, chunks across the shares
    # two DCP groups of two ranks in a TP group of four
    slow_case(("llama", {"num_key_value_heads": 2}, 4, "--dcp", 2, 16)),
    # PCP: each rank computes the tokens whose KV it keeps, through every layer
    ("llama", {"num_key_value_heads": 1}, 2, "--pcp", 2, 5),  # chunks that cut across the shares, uneven rows
    slow_case(("qwen3", {"tie_word_embeddings": True}, 4, "--pcp", 4, 37)),  # the whole prompt over 4, q/k norm
    slow_case(("llama", {}, 4, "--pcp", 2, 5)),  # -tp 2 -pcp 2: each PCP group a TP shard
])
def test_context_parallel_matches_transformers(tiny_model_dir, tmp_path, arch, overrides, world, flag, size, chunk):
    """Each rank keeps block_size / size tokens of every block; every query row attends to each rank's share,
    and the partials merged by log-sum-exp give transformers' greedy tokens and logits (prefill chunks, decode)."""
    model_dir = tiny_model_dir(arch, **overrides)
    prompt = prompts(384, lengths=(37,))[0]
    want_tokens, want_logits = reference_greedy(reference_model(model_dir), prompt, 32)
    got = run_tp(model_dir, world, "2,2", prompt, 32, tmp_path, False, flag, str(size), "--chunk", str(chunk))
    assert got["tokens"] == want_tokens
    torch.testing.assert_close(torch.tensor(got["logits"]), want_logits, atol=1e-4, rtol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("flag", ["--dcp", "--pcp"])
def test_context_parallel_on_the_triton_kernels_matches_transformers(tiny_model_dir, tmp_path, flag):
    """The same on the Triton kernels (interpreted on a CPU: STAGEMESH_KERNELS=triton), as CUDA stages run them:
    a prefill chunk's rows over a rank's share in one prefill-kernel run (paged_attention_rows_lse), decode rows on
    the decode kernel, the merge kernel."""
    model_dir = tiny_model_dir("llama")
    prompt = prompts(384, lengths=(37,))[0]
    want_tokens, want_logits = reference_greedy(reference_model(model_dir), prompt, 8)
    got = run_tp(model_dir, 2, "2,2", prompt, 8, tmp_path, False, flag, "2", "--chunk", "16",
                 env={"STAGEMESH_KERNELS": "triton", "TRITON_INTERPRET": "1"})
    assert got["tokens"] == want_tokens
    torch.testing.assert_close(torch.tensor(got["logits"]), want_logits, atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_default_model_tp3_matches_transformers(default_model_dir, tmp_path):
    # SmolLM2 has 9 heads and 3 KV heads: TP=3 is the smallest size above 1 that divides them
    from transformers import AutoTokenizer

    prompt = AutoTokenizer.from_pretrained(default_model_dir).encode("The capital of France is")
    want_tokens, _ = reference_greedy(reference_model(default_model_dir), prompt, 32)
    got = run_tp(default_model_dir, 3, "15,15", prompt, 32, tmp_path)
    assert got["tokens"] == want_tokens


def test_stage_of_half_the_layers_at_tp2_holds_a_quarter(tmp_path):
    model_dir = make_tiny_model(tmp_path, "llama", num_hidden_layers=8)
    total = sum(t.numel() * t.element_size() for t in reference_model(model_dir).state_dict().values())
    stage = StageRunner.of(model_dir, 0, 4, tp_rank=1, tensor_parallel_size=2)
    ratio = stage.model.num_parameter_bytes() / total
    assert 0.2 < ratio < 0.3, ratio


def test_tp_size_that_does_not_divide_heads_is_refused(tiny_model_dir):
    with pytest.raises(StagemeshError,
                       match=r"does not divide the model's 4 attention heads; sizes that work: 1, 2, 4"):
        StageRunner.of(tiny_model_dir("llama"), 0, 4, tp_rank=0, tensor_parallel_size=3)
    assert ModelConfig.from_path(tiny_model_dir("llama")).valid_tp_sizes(8) == [1, 2, 4]
