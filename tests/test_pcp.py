"""Prefill context parallelism (--prefill-context-parallel-size / -pcp) through real processes: greedy tokens equal
transformers' (alone, with chunked prefill, preemption and async scheduling, and as a -tp 2 -pcp 2 stage 0 of a
PP=2 replica whose stage 1 is -tp 2), a -pcp 2 stage holds twice the tokens of -tp 1 at the same
--kv-cache-memory and serves a prompt -tp 1 refuses, the embedded default model (9 heads: no -tp 2) serves with
-pcp 2 the text transformers generates, and what PCP does not run with is refused at start-up by name. (A killed
PCP follower loses no request: tests/test_dcp.py's killed-rank test, its pcp2 case.)"""
from __future__ import annotations

import re

import pytest

from mesh import Mesh, Router, free_port, start_serve, stop_process, wait_http_ok
from parity import prompts
from stagemesh.core.errors import StagemeshError
from stagemesh.core.sampling_params import SamplingParams
from stagemesh.v1 import scheduler_pb2
from test_dcp import (assert_refused_for_input_tokens, capacity_and_answer, heads_config, refusal, stage,
                      stagemesh)
from tiny_models import reference_model, reference_tokens, with_word_tokenizer

NEW_TOKENS = 16
LENGTHS = (5, 40, 17, 70, 3, 33, 9, 51, 24, 12, 60, 7, 45, 30, 2, 19)  # 16 concurrent requests
PCP2 = ["--prefill-context-parallel-size", "2"]
# bytes per rank: the tiny llama (4 layers, 2 KV heads of 16 float32) takes 16384 bytes a block of 16 tokens with
# -tp 1, 8192 with -pcp 2 (8 tokens of each block a rank): 11 blocks (176 tokens) and 22 (352)
SMALL_KV = ("--kv-cache-memory", "180224")
CHUNKED = ("--max-num-batched-tokens", "64")
LONG_PROMPT = 250  # > 176 tokens (-tp 1), within 352 (-pcp 2) and the model's 512 positions


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny llama with 2 KV heads, with a word tokenizer (for the router)."""
    return with_word_tokenizer(tiny_model_dir("llama"), tmp_path_factory.mktemp("pcp") / "model")


@pytest.fixture(scope="module")
def expected(model_dir):
    batch = prompts(384, LENGTHS)
    ref = reference_model(model_dir)
    return batch, [reference_tokens(ref, p, NEW_TOKENS) for p in batch]


@pytest.mark.slow
def test_pcp_doubles_the_tokens_a_stage_holds_matches_transformers_and_serves_a_prompt_tp1_refuses(
        model_dir, expected, tmp_path):
    """One stage of the tiny llama at the same --kv-cache-memory: -tp 1 holds X tokens, -pcp 2 (two processes, each
    with the whole weights and half of every block) 2X. A prompt between the two is refused by the first with
    vLLM's 400 and served token-exact by the second. The -pcp 2 replica, with async scheduling and 64 tokens a
    step (chunked prefill), also serves 16 concurrent requests that do not fit at once (preemption) with
    transformers' greedy tokens."""
    batch, want = expected
    prompt = prompts(384, (LONG_PROMPT,), seed=7)[0]
    want_long = reference_tokens(reference_model(model_dir), prompt, NEW_TOKENS)
    sizes, answers = {}, {}
    for name, extra in (("tp1", []), ("pcp2", PCP2)):
        logs = tmp_path / name
        logs.mkdir()
        with Mesh(model_dir, [4], log_dir=logs, stage_args=SMALL_KV, per_stage_args={0: extra},
                  scheduler_args=("--async-scheduling", *CHUNKED)) as mesh:
            with Router(model_dir, [mesh.address], ("--served-model-name", "m"), log_dir=logs) as router:
                sizes[name], answers[name] = capacity_and_answer(logs, router.base_url, prompt, name == "tp1")
                if name == "tp1":
                    continue
            log = (logs / "scheduler.log").read_text()
            got = mesh.generate(batch, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
            stats = mesh.stub.GetStats(scheduler_pb2.GetStatsRequest(), timeout=5)
        assert got == want
        assert "async scheduling" in log
        assert stats.num_kv_blocks == 22 and stats.num_preemptions > 0
        assert ("stage 0: prefill context parallel 2 (--prefill-context-parallel-size): 2 processes (TP 1 x PCP 2), "
                "each with its TP shard of the weights, computing and keeping 8 of every block's 16 tokens; 22 "
                "blocks of 16 tokens hold 352 tokens") in (logs / "stage0.log").read_text()
    assert sizes == {"tp1": 176, "pcp2": 352}
    assert_refused_for_input_tokens(answers["tp1"], LONG_PROMPT, 176)
    assert answers["pcp2"] == want_long


@pytest.mark.slow
def test_tp2_pcp2_stage_then_tp2_stage_over_nccl_matches_transformers(model_dir, expected, tmp_path):
    """PP=2: stage 0 (3 layers) is -tp 2 -pcp 2 (four ranks: two PCP groups, each a TP shard of the weights; each
    place's TP group formed by its members as the epoch is joined), its hidden states gathered on rank 0 and
    handed over nccl to stage 1 (1 layer), -tp 2: 16 concurrent requests, prefill chunked at 64 tokens a step,
    give transformers' tokens."""
    batch, want = expected
    with Mesh(model_dir, [3, 1], tp=[2, 2], handoff="nccl", log_dir=tmp_path, per_stage_args={0: PCP2},
              scheduler_args=CHUNKED) as mesh:
        got = mesh.generate(batch, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
    assert got == want
    log = (tmp_path / "stage0.log").read_text()
    assert "prefill context parallel 2 (--prefill-context-parallel-size): 4 processes (TP 2 x PCP 2)" in log
    assert "joined epoch 1 as rank 0 of 6 (layers 0:3, TP=2, PCP=2" in log


CHAT = [{"role": "user", "content": "Write two sentences about why the sky is blue, for a child of seven."}]
CHAT_TOKENS = 32


@pytest.mark.slow
def test_serve_runs_the_default_model_with_pcp2_and_answers_as_transformers(default_model_dir, tmp_path):
    """`stagemesh serve --device cpu -pcp 2` with no model (the embedded SmolLM2-135M: 9 heads, 3 KV heads, which
    -tp 2 cannot split): the official openai client's chat completion at temperature 0 is transformers' greedy
    generation on the same model, and the stage says it runs two processes (TP 1 x PCP 2)."""
    import openai
    from transformers import AutoModelForCausalLM, AutoTokenizer

    port, log_path = free_port(), tmp_path / "serve.log"
    proc = start_serve(["--device", "cpu", "-pcp", "2", "--port", str(port), "--grpc-port", "0", "--threads", "1"],
                       log_path)
    try:
        wait_http_ok(proc, f"http://127.0.0.1:{port}/ready", 120, "stagemesh serve", log_path)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        name = client.models.list().data[0].id
        reply = client.chat.completions.create(model=name, messages=CHAT, temperature=0, max_tokens=CHAT_TOKENS)
    finally:
        stop_process(proc, 30)
    tok = AutoTokenizer.from_pretrained(default_model_dir)
    ids = tok.apply_chat_template(CHAT, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    assert reply.usage.prompt_tokens == ids.shape[1] > 32  # (the prompt spans blocks: both ranks compute)
    ref = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype="float32").eval()
    out = ref.generate(ids, max_new_tokens=CHAT_TOKENS, do_sample=False)[0, ids.shape[1]:]
    assert reply.choices[0].message.content == tok.decode(out, skip_special_tokens=True)
    assert reply.usage.completion_tokens == len(out)
    assert re.search(r"stage 0: prefill context parallel 2 \(--prefill-context-parallel-size\): 2 processes \(TP 1 x "
                     r"PCP 2\), each with its TP shard of the weights, computing and keeping 8 of every block's 16 "
                     r"tokens", log_path.read_text())


# start-up refusals: no mesh

DCP_AND_PCP = ("--prefill-context-parallel-size 2 with --decode-context-parallel-size 2 is not built yet: PCP already "
               "spreads each sequence's KV over its ranks")


@pytest.mark.parametrize("pcp, block, message", [
    (2, 15, "--prefill-context-parallel-size 2 does not divide --block-size 15: each PCP rank keeps "
            "block_size / 2 tokens of every block"),
    (3, 16, "--prefill-context-parallel-size 3 does not divide --block-size 16"),
    (0, 16, "--prefill-context-parallel-size 0 must be at least 1"),
])
def test_pcp_that_cannot_run_is_refused_with_the_reason(pcp, block, message):
    with pytest.raises(StagemeshError) as err:
        heads_config(4, 2).check_prefill_context_parallel(pcp, block)
    assert str(err.value).startswith(message)


def test_pcp_with_dcp_is_refused():
    with pytest.raises(StagemeshError) as err:
        heads_config(4, 2).check_prefill_context_parallel(2, 16, dcp_size=2)
    assert str(err.value) == DCP_AND_PCP


def test_pcp_that_splits_is_accepted():
    heads_config(4, 2).check_prefill_context_parallel(2, 16)
    heads_config(4, 1).check_prefill_context_parallel(4, 16)
    heads_config(4, 2).check_prefill_context_parallel(1, 15)  # -pcp 1: no split, any block size


def test_stage_refuses_pcp_with_dcp(tiny_model_dir):
    result = stage(tiny_model_dir("llama"), "-tp", "2", "-dcp", "2", "-pcp", "2")
    assert refusal(result) == "stagemesh stage: error: " + DCP_AND_PCP


def test_serve_refuses_pcp_with_dcp_before_any_child_starts(tiny_model_dir):
    result = stagemesh("serve", str(tiny_model_dir("llama")), "-tp", "2", "-dcp", "2", "-pcp", "2", "--device", "cpu")
    assert "started" not in result.stderr
    assert refusal(result) == "stagemesh serve: error: " + DCP_AND_PCP


def test_stage_refuses_pcp_with_lora(tiny_model_dir):
    result = stage(tiny_model_dir("llama"), "-pcp", "2", "--enable-lora")
    assert refusal(result) == (
        "stagemesh stage: error: --prefill-context-parallel-size with --enable-lora is not built yet")


def test_stage_refuses_pcp_with_expert_parallel(tiny_model_dir):
    result = stage(tiny_model_dir("mixtral"), "-pcp", "2", "--enable-expert-parallel")
    assert refusal(result) == (
        "stagemesh stage: error: --prefill-context-parallel-size with --enable-expert-parallel is not built yet")


@pytest.mark.slow  # (a stage process that loads its draft model)
def test_stage_refuses_pcp_with_a_draft_model(tiny_model_dir):
    draft = tiny_model_dir("llama", num_hidden_layers=2)
    result = stage(tiny_model_dir("llama"), "-pcp", "2", "--speculative-config",
                   f'{{"model": "{draft}", "num_speculative_tokens": 2}}')
    assert refusal(result) == (
        "stagemesh stage: error: speculative decoding with a draft model does not run with "
        "--prefill-context-parallel-size yet (ngram speculation does)")
