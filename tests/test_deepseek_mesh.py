"""DeepSeek-V3 (and V2-Lite) through the real services, token-exact with transformers on every layout the seeds
run it on, in as few mesh starts as cover them: one stage whose evicted prefix comes back from the host tier
(its KV cache counted in latents, in the log and /metrics); -pp 2 of a -tp 2 --enable-expert-parallel stage
(balanced by EPLB) and a plain -tp 2 one; -dp 2 --enable-expert-parallel; disaggregated prefill from a -tp 2
replica into a -tp 2 -dcp 2 one (the latents cross whole, each DCP rank keeps its share); MTP speculation on a
-pp 2 mesh, its acceptance in the scheduler's /metrics."""
from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from mesh import Mesh, free_port
from parity import prompts
from stagemesh.core.sampling_params import SamplingParams
from test_disaggregated import NEW_TOKENS, assert_decoded, prefill_all, run
from test_dp_ep import two_replicas
from tiny_models import make_tiny_model, reference_model, reference_tokens, with_mtp_layer

pytestmark = pytest.mark.slow
LENGTHS = (5, 40, 17, 70, 3, 33)
LATENT = 32 + 16  # kv_lora_rank + qk_rope_head_dim of tests/tiny_models.py's DeepSeek models
BLOCK_BYTES = 4 * 16 * LATENT * 4  # a block of 16 tokens over 4 layers, fp32
POOL = 11 * BLOCK_BYTES  # --kv-cache-memory: 11 blocks
PROMPT_LEN, FILLER_LEN = 70, 100
HIT = (PROMPT_LEN - 1) // 16 * 16  # the prompt's full blocks (a token is always left to compute)


@pytest.fixture(scope="module")
def expected(tiny_model_dir):
    def want(arch: str, lengths=LENGTHS, seed: int = 0):
        model_dir = tiny_model_dir(arch)
        ref = reference_model(model_dir)
        batch = prompts(384, lengths, seed=seed)
        return model_dir, batch, [reference_tokens(ref, p, NEW_TOKENS) for p in batch]
    return want


def metric(port: int, name: str) -> float:
    text = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


@pytest.mark.parametrize("arch", ["deepseek_v3", "deepseek_v2"])
def test_one_stage_counts_its_cache_in_latents_and_takes_a_prefix_back_from_the_host_tier(expected, tmp_path, arch):
    model_dir, (prompt, *fillers), (want, *_) = expected(arch, (PROMPT_LEN, FILLER_LEN, FILLER_LEN, FILLER_LEN), 44)
    port = free_port()
    sampling = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    with Mesh(model_dir, [4], log_dir=tmp_path, stage_args=("--kv-cache-memory", str(POOL)),
              scheduler_args=("--kv-offloading-size", "0.001", "--metrics-port", str(port))) as mesh:
        assert mesh.submit("cold", prompt, sampling)[0] == want and mesh.cached_tokens["cold"] == 0
        for i, filler in enumerate(fillers):  # the pool's 11 blocks go to other prompts
            mesh.submit(f"filler{i}", filler, sampling)
        assert mesh.submit("from-host", prompt, sampling)[0] == want and mesh.cached_tokens["from-host"] == HIT
        assert metric(port, 'stagemesh:kv_tier_loaded_blocks_total{tier="host"}') == HIT // 16
        tokens = metric(port, "stagemesh:kv_cache_size_tokens")
    # the pool holds 11 blocks of latents: 4.7x the tokens of full K and V heads (4 x (16 + 16 + 24) values)
    assert tokens == 11 * 16
    assert "KV cache size: 176 tokens" in (tmp_path / "scheduler.log").read_text()
    assert POOL // (4 * 4 * (16 + 16 + 24) * 4) < tokens / 4.6


def test_pp2_of_a_tp2_expert_parallel_stage_and_a_tp2_stage(expected, tmp_path):
    """The expert-parallel stage balances its experts as it goes (EPLB, two redundant experts)."""
    model_dir, batch, want = expected("deepseek_v3")
    eplb = ["--enable-expert-parallel", "--enable-eplb", "--eplb-config",
            '{"window_size": 4, "step_interval": 3, "num_redundant_experts": 2}']
    with Mesh(model_dir, [2, 2], tp=[2, 2], handoff="nccl", log_dir=tmp_path, per_stage_args={0: eplb}) as mesh:
        assert mesh.generate(batch, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)) == want
    log = (tmp_path / "stage0.log").read_text()
    assert "expert parallel (EP=2, 4 of 8 experts per rank)" in log
    assert any(int(n) > 0 for n in re.findall(r"EPLB moved experts into (\d+) slot\(s\)", log)), log[-3000:]


def test_dp2_with_the_experts_over_the_replicas(expected, tmp_path):
    model_dir, batch, want = expected("deepseek_v3")
    sampling = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    with two_replicas(model_dir, tmp_path) as (a, b), ThreadPoolExecutor(2) as pool:
        jobs = [pool.submit(m.submit_stream, [(f"{m.port}-{i}", batch[i], sampling) for i in idx])
                for m, idx in ((a, (0, 2, 4)), (b, (1, 3, 5)))]
        got = {**jobs[0].result(), **jobs[1].result()}
    assert [got[f"{(a if i % 2 == 0 else b).port}-{i}"][0] for i in range(len(batch))] == want


def test_disaggregated_prefill_into_a_dcp_replica(expected, tmp_path):
    model_dir, batch, want = expected("deepseek_v3", seed=5)
    (tmp_path / "p").mkdir()
    (tmp_path / "d").mkdir()
    with Mesh(model_dir, [4], tp=[2], log_dir=tmp_path / "p", scheduler_args=("--kv-role", "prefill")) as p, \
            Mesh(model_dir, [4], tp=[2], log_dir=tmp_path / "d", stage_args=("--decode-context-parallel-size", "2"),
                 scheduler_args=("--kv-role", "decode", "--kv-peer", p.address)) as d:
        assert_decoded(run(d, prefill_all(p, batch, want)), want)
    log = (tmp_path / "d" / "scheduler.log").read_text()
    assert log.count("its prompt's KV (") == len(batch), log[-3000:]  # every prompt's latents fetched
    assert not re.search(r"failed|recompute", log)


def test_mtp_speculation_through_a_pp2_mesh(tmp_path):
    """deepseek_mtp on the last stage (given to it and to the scheduler, as a draft model is): transformers' tokens,
    and most of the drafts of an MTP layer that copies the main path accepted, as /metrics counts them."""
    base = make_tiny_model(tmp_path / "base", "deepseek_v3", num_hidden_layers=2, first_k_dense_replace=0)
    model_dir = with_mtp_layer(base, tmp_path / "mtp", copy_of=1)
    ref = reference_model(model_dir)
    batch = prompts(384, LENGTHS)
    want = [reference_tokens(ref, p, NEW_TOKENS) for p in batch]
    spec, port = json.dumps({"method": "deepseek_mtp", "num_speculative_tokens": 2}), free_port()
    with Mesh(model_dir, [1, 1], log_dir=tmp_path, per_stage_args={1: ["--speculative-config", spec]},
              scheduler_args=("--speculative-config", spec, "--metrics-port", str(port))) as mesh:
        assert mesh.generate(batch, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)) == want
        accepted = metric(port, "stagemesh:spec_decode_num_accepted_tokens_total")
        drafted = metric(port, "stagemesh:spec_decode_num_draft_tokens_total")
    assert 0 < accepted <= drafted
    assert "speculative decoding: deepseek_mtp (the model's MTP layer), 2 tokens" in \
        (tmp_path / "scheduler.log").read_text()
