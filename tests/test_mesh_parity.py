"""Greedy tokens through the real services equal transformers' (processes on loopback)."""
from __future__ import annotations

import pytest

from mesh import Mesh
from parity import prompts
from stagemesh.sampling_params import SamplingParams
from stagemesh.v1 import scheduler_pb2
from tiny_models import reference_greedy, reference_model

NEW_TOKENS = 16
LENGTHS = (5, 40, 17, 70, 3, 33, 9, 51, 24, 12, 60, 7, 45, 30, 2, 19)  # 16 concurrent requests

CASES = {
    "tp1-pp1-grpc": dict(split=[4], tp=[1], handoff="grpc"),
    "tp2-pp2-nccl": dict(split=[2, 2], tp=[2, 2], handoff="nccl"),
    "tp1-pp3-uneven-grpc": dict(split=[1, 2, 1], tp=[1, 1, 1], handoff="grpc"),
    "tp2-then-tp1-nccl": dict(split=[3, 1], tp=[2, 1], handoff="nccl"),
    "tp1-pp2-grpc-preemption": dict(split=[2, 2], tp=[1, 1], handoff="grpc",
                                    stage_args=("--kv-cache-memory", "90112"),
                                    scheduler_args=("--max-num-batched-tokens", "64")),
}


@pytest.fixture(scope="module")
def expected(tiny_model_dir):
    model_dir = tiny_model_dir("llama")
    ref = reference_model(model_dir)
    batch = prompts(384, LENGTHS)
    return model_dir, batch, [reference_greedy(ref, p, NEW_TOKENS)[0] for p in batch]


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_mesh_greedy_tokens_match_transformers(expected, tmp_path, case):
    model_dir, batch, want = expected
    with Mesh(model_dir, log_dir=tmp_path, **CASES[case]) as mesh:
        got = mesh.generate(batch, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
        stats = mesh.stub.GetStats(scheduler_pb2.GetStatsRequest(), timeout=5)
    assert got == want
    if case.endswith("preemption"):
        log = (tmp_path / "scheduler.log").read_text()
        assert "KV cache size: 176 tokens" in log  # 90112 bytes hold 11 blocks of 2 layers x 16 tokens
        assert stats.num_kv_blocks == 11 and stats.num_preemptions > 0
