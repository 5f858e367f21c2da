"""Decode context parallelism (--decode-context-parallel-size / -dcp) through real processes: greedy tokens equal
transformers', a replica holds dcp times the tokens where TP replicates the KV heads (and serves a prompt that
plain TP refuses), a stage killed mid-stream loses no request, and the flags that cannot split are refused at
start-up by name."""
from __future__ import annotations

import re
import subprocess
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest
import requests

from mesh import Mesh, Router, completion_ids, run_stagemesh
from parity import prompts
from stagemesh.core.errors import StagemeshError
from stagemesh.core.model_config import ModelConfig
from stagemesh.core.sampling_params import SamplingParams
from stagemesh.v1 import scheduler_pb2
from test_recovery import wait_for_steps
from tiny_models import reference_model, reference_tokens, with_word_tokenizer

NEW_TOKENS = 16
LENGTHS = (5, 40, 17, 70, 3, 33, 9, 51, 24, 12, 60, 7, 45, 30, 2, 19)  # 16 concurrent requests
DCP2 = ["--decode-context-parallel-size", "2"]
SMALL_KV = ("--kv-cache-memory", "90112")  # bytes per rank
CHUNKED = ("--max-num-batched-tokens", "64")

# model: "mqa" is the tiny llama with one KV head (plain TP=2 replicates it), "kv2" the one with two
# (one stage of the MQA model, -tp 2 -dcp 2, async scheduling and preemption: the mesh of
# test_dcp_doubles_the_tokens_a_replica_holds_and_serves_a_prompt_plain_tp_refuses)
CASES = {
    "mqa-pp2-both-tp2-dcp2-nccl-async": dict(model="mqa", split=[2, 2], tp=[2, 2], handoff="nccl",
                                             per_stage_args={0: DCP2, 1: DCP2}, scheduler_args=("--async-scheduling",)),
    # only stage 0 has -dcp 2, on the model with 2 KV heads (each rank keeps both heads, half the tokens)
    "kv2-pp2-dcp2-then-tp1-nccl-preemption": dict(model="kv2", split=[3, 1], tp=[2, 1], handoff="nccl",
                                                  per_stage_args={0: DCP2}, stage_args=SMALL_KV,
                                                  scheduler_args=CHUNKED),
}
# what each case's scheduler logs: stage 0 of the kv2 case holds 14 blocks (3 layers x 2 heads x 8 tokens of
# float32 K and V: 6144 bytes a block per rank, as plain -tp 2 with 1 head x 16 tokens), stage 1 (1 layer, 2 heads,
# 16 tokens) 22: the replica, 14
KV_TOKENS = {"kv2-pp2-dcp2-then-tp1-nccl-preemption": 224}


@pytest.fixture(scope="module")
def models(tiny_model_dir):
    return {"mqa": tiny_model_dir("llama", num_key_value_heads=1), "kv2": tiny_model_dir("llama")}


@pytest.fixture(scope="module")
def expected(models):
    batch = prompts(384, LENGTHS)
    want = {}
    for name, model_dir in models.items():
        ref = reference_model(model_dir)
        want[name] = [reference_tokens(ref, p, NEW_TOKENS) for p in batch]
    return batch, want


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_dcp_greedy_tokens_match_transformers(models, expected, tmp_path, case):
    batch, want = expected
    spec = dict(CASES[case])
    model = spec.pop("model")
    with Mesh(models[model], log_dir=tmp_path, **spec) as mesh:
        got = mesh.generate(batch, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
        stats = mesh.stub.GetStats(scheduler_pb2.GetStatsRequest(), timeout=5)
    assert got == want[model]
    log = (tmp_path / "scheduler.log").read_text()
    if "--async-scheduling" in spec["scheduler_args"]:
        assert "async scheduling" in log
    if case == "mqa-pp2-both-tp2-dcp2-nccl-async":  # 512 MiB a rank (the CPU default): twice plain -tp 2's 131072
        for i in (0, 1):
            assert "TP=2, cpu, nccl handoff, 262144 KV blocks of 16 tokens" in (tmp_path / f"stage{i}.log").read_text()
    if case.endswith("preemption"):
        assert f"KV cache size: {KV_TOKENS[case]} tokens" in log
        assert stats.num_kv_blocks == KV_TOKENS[case] // 16 and stats.num_preemptions > 0


LONG_PROMPT = 250  # > 176 tokens (-tp 2), within 352 (-tp 2 -dcp 2) and the model's 512 positions


@pytest.mark.slow
def test_dcp_doubles_the_tokens_a_replica_holds_and_serves_a_prompt_plain_tp_refuses(models, expected, tmp_path):
    """The MQA model at the same --kv-cache-memory: -tp 2 replicates its one KV head on both ranks and holds X
    tokens; -tp 2 -dcp 2 holds 2X. A prompt between the two is refused by the first with vLLM's 400 and served
    token-exact by the second. The -dcp 2 replica, a single stage with a step ahead in flight (async scheduling)
    and 64 tokens a step, also serves 16 concurrent requests that do not fit at once with transformers' greedy
    tokens: its 90112 bytes a rank hold 22 blocks of 16 tokens (8 tokens a block per rank, 4 layers, 1 KV head),
    and 16 requests of up to 6 blocks each are preempted."""
    batch, want_batch = expected
    model_dir = with_word_tokenizer(models["mqa"], tmp_path / "model")
    prompt = prompts(384, (LONG_PROMPT,), seed=7)[0]
    want = reference_tokens(reference_model(model_dir), prompt, NEW_TOKENS)
    sizes, answers = {}, {}
    for name, extra in (("tp2", []), ("tp2-dcp2", DCP2)):
        logs = tmp_path / name
        logs.mkdir()
        with Mesh(model_dir, [4], tp=[2], handoff="nccl", log_dir=logs, stage_args=SMALL_KV,
                  per_stage_args={0: extra}, scheduler_args=("--async-scheduling", *CHUNKED)) as mesh:
            with Router(model_dir, [mesh.address], ("--served-model-name", "m"), log_dir=logs) as router:
                sizes[name], answers[name] = capacity_and_answer(logs, router.base_url, prompt, name == "tp2")
            if name == "tp2":
                continue
            got = mesh.generate(batch, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
            stats = mesh.stub.GetStats(scheduler_pb2.GetStatsRequest(), timeout=5)
        log = (logs / "scheduler.log").read_text()
        assert got == want_batch["mqa"]
        assert "async scheduling" in log
        assert "KV cache size: 352 tokens" in log
        assert stats.num_kv_blocks == 352 // 16 and stats.num_preemptions > 0
    assert sizes == {"tp2": 176, "tp2-dcp2": 352}
    assert_refused_for_input_tokens(answers["tp2"], LONG_PROMPT, 176)
    assert answers["tp2-dcp2"] == want


def capacity_and_answer(logs, base_url: str, prompt: list[int], refused: bool) -> tuple[int, object]:
    """A replica's KV cache size in tokens (its scheduler's log, its max_model_len and 1.00x concurrency), and
    its answer to `prompt`: the HTTP response where it is to be refused, else the greedy token ids."""
    log = (logs / "scheduler.log").read_text()
    size = int(re.search(r"KV cache size: ([\d,]+) tokens", log).group(1).replace(",", ""))
    assert re.search(rf"Maximum concurrency for {size} tokens per request: 1\.00x", log)
    assert requests.get(f"{base_url}/v1/models", timeout=10).json()["data"][0]["max_model_len"] == size
    if refused:
        body = {"model": "m", "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0}
        return size, requests.post(f"{base_url}/v1/completions", json=body, timeout=60)
    return size, completion_ids(base_url, "m", prompt, NEW_TOKENS)


def assert_refused_for_input_tokens(resp, prompt_tokens: int, context: int) -> None:
    """vLLM's 400 for a prompt that does not fit the context, naming input_tokens."""
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["message"].startswith(
        f"You passed {prompt_tokens} input tokens and requested {NEW_TOKENS} output tokens. However, the model's "
        f"context length is only {context} tokens, resulting in a maximum input length of {context - NEW_TOKENS} "
        "tokens")
    assert error["param"] == "input_tokens"


KILL_TOKENS = 64
KILL_LENGTHS = (5, 40, 17, 70, 3, 33, 9, 51)


def follower_of(stage) -> psutil.Process:
    children = psutil.Process(stage.pid).children()  # (a stage's only children are its followers)
    assert len(children) == 1, children
    return children[0]


@pytest.mark.slow
@pytest.mark.parametrize("model, tp, flags", [("mqa", 2, DCP2), ("kv2", 1, ["--prefill-context-parallel-size", "2"])],
                         ids=["tp2-dcp2", "pcp2"])
def test_a_killed_context_parallel_rank_loses_no_request(models, tmp_path, model, tp, flags):
    """8 greedy streams on a -tp 2 -dcp 2 stage (the MQA model) or a -pcp 2 one; rank 1 (the follower: half of
    every block's KV, and with PCP the whole weights) is SIGKILLed mid-stream; rank 0 sees it gone, fails the step
    and exits with an error. The stage is restarted with the same command and every stream ends with
    transformers' tokens. (A killed rank 0 takes its follower with it and is a stage killed mid-stream, as
    tests/test_recovery.py has it.)"""
    model_dir = models[model]
    ref = reference_model(model_dir)
    batch = prompts(384, KILL_LENGTHS)
    want = [reference_tokens(ref, p, KILL_TOKENS) for p in batch]
    greedy = SamplingParams(max_tokens=KILL_TOKENS, ignore_eos=True)
    with Mesh(model_dir, [4], tp=[tp], handoff="nccl", log_dir=tmp_path, per_stage_args={0: flags},
              scheduler_args=("--stage-recovery-timeout", "90")) as mesh:
        follower = follower_of(mesh.stages[0])
        with ThreadPoolExecutor(1) as pool:
            streaming = pool.submit(mesh.submit_stream, [(f"g{i}", p, greedy) for i, p in enumerate(batch)], 240)
            wait_for_steps(mesh, 6)  # prompts computed, a few tokens streamed each
            follower.kill()
            assert mesh.stages[0].wait(timeout=60) == 2  # rank 0 stops on its own
            mesh.start_stage(0)  # the same command
            results = streaming.result(timeout=240)
    for i in range(len(batch)):
        assert results[f"g{i}"] == (want[i], "length"), f"greedy stream {i}"
    log = (tmp_path / "scheduler.log").read_text()
    assert int(re.search(r"keeping (\d+) request\(s\)", log).group(1)) == len(batch), "all were in flight"
    assert len(re.findall(r"request g\d+ recovered after a [\d.]+s stall", log)) == len(batch)
    assert f"TP rank 1 (pid {follower.pid}) is gone" in log
    assert "stagemesh stage: error: a TP follower of this stage died; the stage stops" in (
        tmp_path / "stage0.log").read_text()


# start-up refusals: no mesh

def heads_config(heads: int, kv_heads: int) -> ModelConfig:
    return ModelConfig.from_dict({"model_type": "llama", "architectures": ["LlamaForCausalLM"],
                                  "hidden_size": 8 * heads, "intermediate_size": 64, "num_hidden_layers": 2,
                                  "num_attention_heads": heads, "num_key_value_heads": kv_heads, "vocab_size": 384,
                                  "max_position_embeddings": 512})


@pytest.mark.parametrize("heads, kv, tp, dcp, block, message", [
    (4, 2, 2, 3, 16, "--decode-context-parallel-size 3 does not divide --tensor-parallel-size 2: a DCP group is 3 "
                     "of a stage's TP ranks"),
    (4, 1, 2, 2, 15, "--decode-context-parallel-size 2 does not divide --block-size 15: each rank of a DCP group "
                     "holds block_size / 2 tokens of every block"),
    # -tp 12 splits 12 heads over 4 KV heads (3 ranks a head), but -dcp 2 shards them as if TP were 6, which
    # neither divides nor replicates the 4 KV heads
    (12, 4, 12, 2, 16, "--decode-context-parallel-size 2 with --tensor-parallel-size 12 shards the KV heads over 6 "
                       "groups, which the model cannot: --tensor-parallel-size 6 does not divide"),
    (4, 2, 2, 0, 16, "--decode-context-parallel-size 0 must be at least 1"),
])
def test_dcp_that_cannot_split_is_refused_with_the_reason(heads, kv, tp, dcp, block, message):
    cfg = heads_config(heads, kv)
    cfg.check_tp_size(tp)  # (the TP size alone is fine)
    with pytest.raises(StagemeshError) as err:
        cfg.check_decode_context_parallel(tp, dcp, block)
    assert str(err.value).startswith(message)


def test_dcp_that_splits_is_accepted():
    heads_config(4, 1).check_decode_context_parallel(2, 2, 16)
    heads_config(4, 2).check_decode_context_parallel(4, 2, 16)
    heads_config(4, 2).check_decode_context_parallel(2, 1, 15)  # -dcp 1: no split, any block size


def stagemesh(*args: str) -> subprocess.CompletedProcess:
    return run_stagemesh([*args], timeout=120)


def stage(model_dir, *args: str) -> subprocess.CompletedProcess:
    # (nothing listens at port 1: a stage that passed its checks would wait for the scheduler, and time out here)
    return stagemesh("stage", str(model_dir), "--scheduler", "127.0.0.1:1", "--stage-index", "0", "--layers", "0:4",
                     *args)


def refusal(result: subprocess.CompletedProcess) -> str:
    """The last line of a command line's refusal: exit 2, its error said, no Traceback."""
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    return result.stderr.strip().splitlines()[-1]


def test_stage_refuses_a_block_size_dcp_does_not_divide(tiny_model_dir):
    result = stage(tiny_model_dir("llama", num_key_value_heads=1), "-tp", "2", "-dcp", "2", "--block-size", "15")
    assert refusal(result) == (
        "stagemesh stage: error: --decode-context-parallel-size 2 does not divide --block-size 15: each rank of a "
        "DCP group holds block_size / 2 tokens of every block")


def test_serve_refuses_dcp_that_does_not_divide_tp(tiny_model_dir):
    result = stagemesh("serve", str(tiny_model_dir("llama")), "-tp", "2", "-dcp", "3", "--device", "cpu")
    assert refusal(result) == (
        "stagemesh serve: error: --decode-context-parallel-size 3 does not divide --tensor-parallel-size 2: a DCP "
        "group is 3 of a stage's TP ranks (as vLLM's)")


def test_stage_refuses_dcp_with_expert_parallel(tiny_model_dir):
    # a mixture-of-experts model whose 8 experts split over 2 ranks: only the pairing with -dcp is refused
    result = stage(tiny_model_dir("mixtral"), "-tp", "2", "-dcp", "2", "--enable-expert-parallel")
    assert refusal(result) == (
        "stagemesh stage: error: --decode-context-parallel-size with --enable-expert-parallel is not built yet")


@pytest.mark.slow  # (a stage process that loads its draft model)
def test_stage_refuses_dcp_with_a_draft_model(tiny_model_dir):
    draft = tiny_model_dir("llama", num_hidden_layers=2)
    result = stage(tiny_model_dir("llama"), "-tp", "2", "-dcp", "2", "--speculative-config",
                   f'{{"model": "{draft}", "num_speculative_tokens": 2}}')
    assert refusal(result) == (
        "stagemesh stage: error: speculative decoding with a draft model does not run with "
        "--decode-context-parallel-size yet (ngram speculation does)")
