"""Greedy tokens through the real services equal transformers' (processes on loopback)."""
from __future__ import annotations

import pytest

from mesh import Mesh
from parity import prompts
from stagemesh.core.sampling_params import SamplingParams
from stagemesh.v1 import scheduler_pb2
from tiny_models import reference_model, reference_tokens

NEW_TOKENS = 16
LENGTHS = (5, 40, 17, 70, 3, 33, 9, 51, 24, 12, 60, 7, 45, 30, 2, 19)  # 16 concurrent requests

CASES = {
    "tp1-pp1-grpc": dict(split=[4], tp=[1], handoff="grpc"),
    "tp2-pp2-nccl": dict(split=[2, 2], tp=[2, 2], handoff="nccl"),
    "tp1-pp3-uneven-grpc": dict(split=[1, 2, 1], tp=[1, 1, 1], handoff="grpc"),
    "tp2-then-tp1-nccl": dict(split=[3, 1], tp=[2, 1], handoff="nccl"),
    # a single stage has a step ahead in flight (async scheduling): rank 0 fills in the sampled tokens
    # before the step goes to its TP follower, and preemption must not touch a step ahead
    "tp2-pp1-nccl-async-preemption": dict(split=[4], tp=[2], handoff="nccl",
                                          stage_args=("--kv-cache-memory", "90112"),
                                          scheduler_args=("--max-num-batched-tokens", "64")),
    "tp1-pp2-grpc-preemption": dict(split=[2, 2], tp=[1, 1], handoff="grpc",
                                    stage_args=("--kv-cache-memory", "90112"),
                                    scheduler_args=("--max-num-batched-tokens", "64")),
}


for _case in CASES.values():  # every layout with steps scheduled ahead (on CPU the default is without)
    _case["scheduler_args"] = (*_case.get("scheduler_args", ()), "--async-scheduling")


# the layouts whose mesh also shows a lone request running ahead through the pipeline
LONE_CASES = ("tp2-then-tp1-nccl", "tp1-pp3-uneven-grpc")
ASYNC_CASE = "tp1-pp1-grpc"  # its mesh also samples and stops as one without async scheduling


@pytest.fixture(scope="module")
def expected(tiny_model_dir):
    model_dir = tiny_model_dir("llama")
    ref = reference_model(model_dir)
    batch = prompts(384, LENGTHS)
    return model_dir, batch, [reference_tokens(ref, p, NEW_TOKENS) for p in batch]


@pytest.fixture(scope="module")
def others(expected):
    """Prompts the batch shares no block with (another seed), with transformers' greedy tokens: what a mesh
    checks beside the batch neither reads the batch's prefix cache nor leaves the batch any."""
    model_dir = expected[0]
    ref = reference_model(model_dir)
    batch = prompts(384, LENGTHS, seed=1)
    return batch, [reference_tokens(ref, p, NEW_TOKENS) for p in batch]


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_mesh_greedy_tokens_match_transformers(expected, others, tmp_path, case):
    """And, on the meshes of LONE_CASES, a lone request runs ahead (checked first, on the fresh mesh: the stage's
    log line is then the lone requests'); on ASYNC_CASE's, async scheduling stops and samples as without it."""
    model_dir, batch, want = expected
    with Mesh(model_dir, log_dir=tmp_path, **CASES[case]) as mesh:
        if case in LONE_CASES:
            _check_a_lone_request_runs_ahead(mesh, others, tmp_path)
        got = mesh.generate(batch, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
        stats = mesh.stub.GetStats(scheduler_pb2.GetStatsRequest(), timeout=5)
        if case == ASYNC_CASE:
            with_async = mesh.submit_stream(_stops_and_seeded_samples(others)[0])
    assert got == want
    log = (tmp_path / "scheduler.log").read_text()
    assert "async scheduling" in log
    if case.endswith("preemption"):
        # 90112 bytes hold 11 blocks of 16 tokens: of 2 layers, or of 4 layers with the KV heads over 2 ranks
        assert "KV cache size: 176 tokens" in log
        assert stats.num_kv_blocks == 11 and stats.num_preemptions > 0
    if case == ASYNC_CASE:
        _check_async_scheduling_stops_and_samples_as_without_it(model_dir, tmp_path, others, with_async)


def _stops_and_seeded_samples(others) -> tuple[list, dict]:
    """Half greedy, stopping at the token transformers makes 6th; half seeded sampling with penalties (which read
    the tokens a step ahead fills in). The requests, and the tokens of those that stop."""
    batch, want = others
    requests, stops = [], {}
    for i, prompt in enumerate(batch):
        if i % 2 == 0:
            stops[f"r{i}"] = want[i][:want[i].index(want[i][5]) + 1]
            sampling = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True, stop_token_ids=(want[i][5],))
        else:
            sampling = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True, temperature=1.0, seed=i,
                                      repetition_penalty=1.3, frequency_penalty=0.5)
        requests.append((f"r{i}", prompt, sampling))
    return requests, stops


def _check_async_scheduling_stops_and_samples_as_without_it(model_dir, tmp_path, others, got: dict) -> None:
    """Steps sent ahead of their tokens: a request that stops (stop token) has its step ahead dropped, and
    seeded sampling with penalties draws the same tokens as on a mesh without async scheduling."""
    requests, stops = _stops_and_seeded_samples(others)
    stop = "stop"
    assert {r: got[r] for r in stops} == {r: (tokens, stop) for r, tokens in stops.items()}
    (tmp_path / "sync").mkdir()
    with Mesh(model_dir, [4], log_dir=tmp_path / "sync", scheduler_args=("--no-async-scheduling",)) as mesh:
        assert got == mesh.submit_stream(requests)


def _check_a_lone_request_runs_ahead(mesh: Mesh, others, tmp_path) -> None:
    """One request at a time leaves a pipeline's other micro-batch empty: the scheduler sends the request's
    next step ahead and the first stage takes its token from the last stage, not from the scheduler."""
    batch, want = others
    stop_at = want[2][5]
    plain = [mesh.submit(f"lone{i}", batch[i], SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
             for i in (0, 3)]
    stopped = mesh.submit("lone2", batch[2], SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True,
                                                            stop_token_ids=(stop_at,)))
    assert [tokens for tokens, _ in plain] == [want[0], want[3]]
    assert stopped == (want[2][:want[2].index(stop_at) + 1], "stop")
    assert "take their sampled tokens from the last stage" in (tmp_path / "stage0.log").read_text()
