"""Mixture-of-experts models through the real services: a PP=2 mesh with expert parallelism in one
stage gives transformers' greedy tokens (Mixtral, Qwen2-MoE, Qwen3-MoE) and its stages count the tokens
routed to each expert; layouts that cannot work are refused at the command line."""
from __future__ import annotations

import re
import subprocess

import pytest
import requests

from mesh import Mesh, free_port, run_stagemesh
from parity import prompts
from stagemesh.core.sampling_params import SamplingParams
from tiny_models import reference_model, reference_tokens

NEW_TOKENS = 12
LENGTHS = (5, 40, 17, 70, 3, 33, 9, 24)  # 8 concurrent requests


def expert_tokens(url: str) -> tuple[float, dict[tuple[int, int], float]]:
    """(stagemesh:stage_tokens_total, {(layer, expert): stagemesh:moe_expert_tokens_total}) of one stage."""
    tokens, load = 0.0, {}
    for line in requests.get(url, timeout=10).text.splitlines():
        if line.startswith("stagemesh:stage_tokens_total{"):
            tokens = float(line.rsplit(" ", 1)[1])
        elif line.startswith("stagemesh:moe_expert_tokens_total{"):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', line))
            load[int(labels["layer"]), int(labels["expert"])] = float(line.rsplit(" ", 1)[1])
    return tokens, load


@pytest.mark.slow
@pytest.mark.parametrize("arch,ep_stage", [("qwen2_moe", 0), ("mixtral", 1), ("qwen3_moe", 0)])
def test_pp2_mesh_with_expert_parallel_in_one_stage_matches_transformers(tiny_model_dir, tmp_path, arch, ep_stage):
    model_dir = tiny_model_dir(arch)
    ref = reference_model(model_dir)
    batch = prompts(384, LENGTHS)
    want = [reference_tokens(ref, p, NEW_TOKENS) for p in batch]
    ports = [free_port(), free_port()]
    stage_args = {i: ["--metrics-port", str(port)] for i, port in enumerate(ports)}
    stage_args[ep_stage].append("--enable-expert-parallel")
    tp = [2 if i == ep_stage else 1 for i in (0, 1)]
    with Mesh(model_dir, [2, 2], tp=tp, handoff="nccl", log_dir=tmp_path, per_stage_args=stage_args) as mesh:
        got = mesh.generate(batch, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
        loads = [expert_tokens(f"http://127.0.0.1:{port}/metrics") for port in ports]
    assert got == want
    layouts = {ep_stage: "expert parallel (EP=2, 4 of 8 experts per rank): rank 0: experts 0-3; rank 1: experts 4-7",
               1 - ep_stage: "tensor parallel: each of the 1 rank(s) holds all 8 experts"}
    for stage, layout in layouts.items():
        assert layout in (tmp_path / f"stage{stage}.log").read_text()
    routed = sum(len(p) + NEW_TOKENS - 1 for p in batch)  # every prompt token and every decode token
    for (tokens, load), layers in zip(loads, ((0, 1), (2, 3))):
        assert tokens == routed
        assert sorted(load) == [(layer, e) for layer in layers for e in range(8)]
        for layer in layers:  # top-2: each token reaches two experts of every sparse layer
            assert sum(load[layer, e] for e in range(8)) == 2 * routed


def stagemesh(*args: str) -> subprocess.CompletedProcess:
    return run_stagemesh([*args], timeout=120)


@pytest.mark.parametrize("arch,overrides,tp,message", [
    ("llama", {}, "2", "--enable-expert-parallel needs a mixture-of-experts model; llama has no experts"),
    ("mixtral", {"num_local_experts": 6}, "4", "the model's 6 experts do not split evenly over "
                                              "--tensor-parallel-size 4 ranks (EP size = TP size)"),
])
def test_stage_refuses_expert_parallel_that_cannot_work(tiny_model_dir, arch, overrides, tp, message):
    result = stagemesh("stage", str(tiny_model_dir(arch, **overrides)), "--scheduler", "127.0.0.1:1",
                       "--stage-index", "0", "--layers", "0:4", "-tp", tp, "--enable-expert-parallel")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert message in result.stderr
