"""Data-parallel attention with the experts spread over the replicas (`--data-parallel-size 2
--enable-expert-parallel`, stage_worker.ep_group): each replica's scheduler and stage serve their own
requests, the two stages hold half the experts each, and the MoE layers meet in every forward. Tokens
equal transformers' with both replicas busy and with one idle (its stage runs dummy forwards); a dead
member fails every replica's requests with a clear error, hangs nothing, and the group re-forms once its
stages are started again (by `serve`, which restarts them)."""
from __future__ import annotations

import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import pytest
import requests

from mesh import Mesh, completion_ids, free_port, run_stagemesh, start_serve
from parity import prompts
from stagemesh.core.model_config import ModelConfig
from stagemesh.core.sampling_params import SamplingParams
from tiny_models import reference_model, reference_tokens, with_word_tokenizer

pytestmark = pytest.mark.slow
NEW_TOKENS = 10
LENGTHS = (5, 40, 17, 70, 3, 33)
EXIT_BROKEN = 3  # stage_worker.ep_group


def ep_flags(rank: int, store_port: int) -> list[str]:
    return ["--enable-expert-parallel", "--data-parallel-size", "2", "--data-parallel-rank", str(rank),
            "--data-parallel-address", "127.0.0.1", "--data-parallel-rpc-port", str(store_port)]


@contextmanager
def two_replicas(model_dir, log_dir, metrics_ports=(None, None)):
    """Two single-stage replicas whose stages form one EP group; stopped on exit."""
    layers = ModelConfig.from_path(model_dir).num_hidden_layers
    store_port = free_port()
    meshes = []
    for rank, metrics in enumerate(metrics_ports):
        extra = ep_flags(rank, store_port) + (["--metrics-port", str(metrics)] if metrics else [])
        (log_dir / f"r{rank}").mkdir()
        # (a dead member fails the requests at once: recovery is the same as any replica's, tests/test_recovery.py)
        meshes.append(Mesh(model_dir, [layers], log_dir=log_dir / f"r{rank}", per_stage_args={0: extra},
                           scheduler_args=("--stage-recovery-timeout", "0")))
    try:
        for mesh in meshes:  # the stages wait for each other: start both before waiting for either
            mesh.start()
        for mesh in meshes:
            mesh.wait_healthy()
        yield meshes
    finally:
        for mesh in meshes:
            mesh.__exit__()


def scrape(port: int) -> dict[str, float]:
    out = {}
    for line in requests.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text.splitlines():
        if line.startswith("stagemesh:") and " " in line:
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def routed(metrics: dict[str, float]) -> float:
    return sum(v for k, v in metrics.items() if k.startswith("stagemesh:moe_expert_tokens_total{"))


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_busy_and_idle_replicas_match_transformers(tiny_model_dir, tmp_path, arch):
    model_dir = tiny_model_dir(arch)
    ref = reference_model(model_dir)
    batch = prompts(384, LENGTHS)
    want = [reference_tokens(ref, p, NEW_TOKENS) for p in batch]
    sampling = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    ports = (free_port(), free_port())
    with two_replicas(model_dir, tmp_path, ports) as (a, b):
        # both busy at once, different requests on each
        with ThreadPoolExecutor(2) as pool:
            jobs = [pool.submit(m.submit_stream, [(f"{m.port}-{i}", batch[i], sampling) for i in idx])
                    for m, idx in ((a, (0, 2, 4)), (b, (1, 3, 5)))]
            both = {**jobs[0].result(), **jobs[1].result()}
        idle_before = scrape(ports[0])
        # only replica b has requests: replica a's stage takes part in every forward without any of its own
        only_b = b.submit_stream([(f"b-{i}", p, sampling) for i, p in enumerate(batch)])
        idle_after = scrape(ports[0])
    got_both = [both[f"{(a if i % 2 == 0 else b).port}-{i}"] for i in range(len(batch))]
    assert [tokens for tokens, _ in got_both] == want
    assert [only_b[f"b-{i}"][0] for i in range(len(batch))] == want
    dummy = 'stagemesh:ep_ticks_total{kind="dummy",stage="0"}'
    assert idle_after[dummy] - idle_before.get(dummy, 0) >= NEW_TOKENS  # one per step of b's at least
    assert routed(idle_after) == routed(idle_before)  # it routed none of its own tokens meanwhile
    for rank, experts in ((0, "0-3"), (1, "4-7")):
        log = (tmp_path / f"r{rank}" / "stage0.log").read_text()
        assert (f"expert parallel across 2 data-parallel replicas (EP=2, 4 of 8 experts per replica's stage): "
                f"this one (DP rank {rank}) holds experts {experts}") in log


def test_a_dead_member_fails_every_replicas_requests_then_the_group_reforms(tiny_model_dir, tmp_path):
    model_dir = tiny_model_dir("qwen3_moe")
    ref = reference_model(model_dir)
    prompt = prompts(384, (12,))[0]
    want = reference_tokens(ref, prompt, NEW_TOKENS)
    long = SamplingParams(max_tokens=300, ignore_eos=True)
    with two_replicas(model_dir, tmp_path) as (a, b):
        with ThreadPoolExecutor(1) as pool:
            streaming = pool.submit(a.submit_stream, [("long", prompt, long)], 120)
            time.sleep(1.0)  # decoding on replica a, with b's stage in every forward
            started = time.monotonic()
            b.kill_stage(0)
            failed = streaming.result(timeout=90)["long"]
        assert not isinstance(failed, tuple), "the request outlived its expert-parallel group"
        assert "expert-parallel group" in failed.message, failed.message
        assert time.monotonic() - started < 60
        assert a.stages[0].wait(timeout=30) == EXIT_BROKEN  # fails its step, then exits to re-form the group
        assert "this stage exits so that the group re-forms" in (tmp_path / "r0" / "stage0.log").read_text()
        for mesh in (a, b):  # what a supervisor (`serve`) does
            mesh.start_stage(0)
        for mesh in (a, b):
            mesh.wait_healthy()
        for mesh in (a, b):
            assert mesh.submit("after", prompt, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))[0] == want


def test_a_broken_member_refuses_to_join_a_new_epoch():
    """Between its failed step and its exit (BROKEN_LINGER_S) a broken member still answers; a JoinPipeline
    then must be refused, or its scheduler forms a pipeline on a stage about to be gone (seen once in the
    suite: the replica was healthy and its next request found the stage's port closed)."""
    from types import SimpleNamespace

    from stage_worker.ep_group import EPConfig, EPGroup, EPGroupBroken
    from stage_worker.worker import StageWorker

    group = EPGroup(EPConfig(dp_rank=0, dp_size=2, address="127.0.0.1", port=free_port()), 0)
    group.raise_if_broken()  # a whole group: nothing to refuse
    group.broken = "Connection closed by peer"
    with pytest.raises(EPGroupBroken, match="is broken .*Connection closed by peer.*this stage exits"):
        StageWorker.check_join(SimpleNamespace(ep=group, cfg=None), None)


def test_serve_dp2_with_expert_parallel_matches_transformers(tiny_model_dir, tmp_path):
    model_dir = with_word_tokenizer(tiny_model_dir("mixtral"), tmp_path / "model")
    batch = prompts(384, LENGTHS)
    ref = reference_model(model_dir)
    want = [reference_tokens(ref, p, NEW_TOKENS) for p in batch]
    port, log = free_port(), tmp_path / "serve.log"
    proc = start_serve([str(model_dir), "-dp", "2", "--enable-expert-parallel", "--device", "cpu", "--port", str(port),
                        "--grpc-port", "0", "--served-model-name", "moe", "--threads", "1"], log)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            try:
                replicas = requests.get(f"{base}/health", timeout=2).json()["replicas"]
                if len(replicas) == 2 and all(r["healthy"] for r in replicas):
                    break
            except (requests.RequestException, KeyError, ValueError):
                pass
            time.sleep(0.3)
        else:
            pytest.fail("not ready:\n" + log.read_text()[-3000:])
        with ThreadPoolExecutor(len(batch)) as pool:
            got = list(pool.map(lambda p: completion_ids(base, "moe", p, NEW_TOKENS), batch))
        assert got == want
        text = log.read_text()
        assert re.search(r"stage\[1\.0\] \(pid \d+\): stagemesh stage .*--data-parallel-rank 1 ", text)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)


@pytest.mark.parametrize("extra,message", [
    (("-tp", "2"), "built for -tp 1 -pp 1 CPU stages only; not yet with -tp 2"),
    (("-pp", "2"), "built for -tp 1 -pp 1 CPU stages only; not yet with -pp 2"),
])
def test_serve_refuses_layouts_not_built_yet(tiny_model_dir, extra, message):
    result = run_stagemesh(["serve", str(tiny_model_dir("mixtral")), "-dp", "2",
                             "--enable-expert-parallel", "--device", "cpu", *extra], timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert message in result.stderr


@pytest.mark.parametrize("extra,message", [
    ((), "--data-parallel-size on a stage spreads its experts over the replicas: it needs --enable-expert-parallel"),
    (("--enable-expert-parallel", "--layers", "0:2"), "built for TP=1, PP=1 CPU stages only; not yet with --layers "
                                                      "0:2"),
    (("--enable-expert-parallel", "-tp", "2"), "not yet with --tensor-parallel-size 2"),
    (("--enable-expert-parallel", "--data-parallel-rank", "2"), "--data-parallel-rank 2 must be in [0, 2)"),
])
def test_stage_refuses_what_is_not_built_or_cannot_work(tiny_model_dir, extra, message):
    argv = ["stage", str(tiny_model_dir("mixtral")), "--scheduler", "127.0.0.1:1", "--stage-index", "0",
            "--layers", "0:4", "--data-parallel-size", "2", *extra]
    result = run_stagemesh([*argv], timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert message in result.stderr
