"""Speculative decoding through real services: greedy tokens equal transformers' through PP, TP (prompt
lookup, with decode or prefill context parallelism) and PP x TP (a draft model) meshes of a tiny model, with
preemption, chunked prefill and structured outputs, and through the gateway on the default model with the openai
client, acceptance counted in both services' metrics."""
from __future__ import annotations

import json
import time

import pytest
import requests

from mesh import Mesh, Router, free_port
from parity import prompts
from stagemesh.core.sampling_params import SamplingParams, StructuredOutputs
from stagemesh.v1 import scheduler_pb2
from test_structured_outputs import WORDS, constrained_greedy
from tiny_models import first_layers, reference_model, reference_tokens, with_word_tokenizer

pytestmark = pytest.mark.slow
NEW_TOKENS = 16
NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1})
LAYOUTS = {
    # a small KV cache and token budget: chunked prefill and preemption under speculation
    "pp2-grpc-preemption": dict(split=[2, 2], tp=[1, 1], handoff="grpc", stage_args=("--kv-cache-memory", "90112"),
                                scheduler_args=("--max-num-batched-tokens", "64")),
    # decode and prefill context parallelism: a sequence's drafts are rows of its chunk, over each rank's share
    "tp2-dcp2-nccl": dict(split=[4], tp=[2], handoff="nccl", per_stage_args={0: ["-dcp", "2"]}),
    "pp2-pcp2-nccl": dict(split=[2, 2], tp=[1, 1], handoff="nccl", per_stage_args={0: ["-pcp", "2"], 1: ["-pcp", "2"]}),
    # a draft model (the target's first two layers) on the last stage's TP rank 0
    "pp2-tp2-nccl-draft-model": dict(split=[2, 2], tp=[2, 2], handoff="nccl"),
}


@pytest.fixture(scope="module")
def expected(tiny_model_dir, tmp_path_factory):
    from transformers import AutoTokenizer

    from stagemesh.core.grammar import GrammarCompiler

    root = tmp_path_factory.mktemp("spec-mesh")
    model_dir = with_word_tokenizer(tiny_model_dir("llama"), root / "model")
    first_layers(model_dir, root / "draft", 2)
    ref = reference_model(model_dir)
    batch = prompts(384, (5, 40, 17, 70, 3, 33, 9, 51)) + [[5, 6, 7, 8, 9] * 8, [10, 11, 12] * 10]
    compiled = GrammarCompiler(AutoTokenizer.from_pretrained(model_dir), 384, [2]).compile(
        StructuredOutputs("regex", WORDS))
    constrained = [constrained_greedy(ref, compiled, p, NEW_TOKENS, 2) for p in batch[:3]]
    return model_dir, batch, [reference_tokens(ref, p, NEW_TOKENS) for p in batch], constrained


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_greedy_tokens_with_speculation_equal_transformers(expected, tmp_path, layout):
    model_dir, batch, want, want_constrained = expected
    case = dict(LAYOUTS[layout])
    spec = NGRAM
    if layout.endswith("draft-model"):
        spec = json.dumps({"model": str(model_dir.parent / "draft"), "num_speculative_tokens": 3})
        case["per_stage_args"] = {len(case["split"]) - 1: ["--speculative-config", spec]}
    scheduler_args = (*case.get("scheduler_args", ()), "--speculative-config", spec)
    plain = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    stop_at = want[-2][6]  # inside a run of drafts the loop makes likely
    requests_ = [(f"r{i}", p, plain) for i, p in enumerate(batch)]
    requests_.append(("stop", batch[-2], SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True,
                                                        stop_token_ids=(stop_at,))))
    requests_ += [(f"c{i}", p, SamplingParams(max_tokens=NEW_TOKENS, structured=StructuredOutputs("regex", WORDS)))
                  for i, p in enumerate(batch[:3])]
    with Mesh(model_dir, log_dir=tmp_path, **{**case, "scheduler_args": scheduler_args}) as mesh:
        got = mesh.submit_stream(requests_)
        stats = mesh.stub.GetStats(scheduler_pb2.GetStatsRequest(), timeout=5)
    assert [got[f"r{i}"][0] for i in range(len(batch))] == want
    assert got["stop"] == (want[-2][:want[-2].index(stop_at) + 1], "stop")
    assert [got[f"c{i}"] for i in range(3)] == [(tokens, "stop") for tokens in want_constrained]
    assert stats.spec_decode_num_accepted_tokens > 0 and stats.spec_decode_num_drafts > 0
    assert sum(stats.spec_decode_num_accepted_tokens_per_pos) == stats.spec_decode_num_accepted_tokens
    log = (tmp_path / "scheduler.log").read_text()
    assert "speculative decoding: ngram, 3 tokens" in log or "speculative decoding: draft model" in log
    if layout.endswith("preemption"):
        assert stats.num_preemptions > 0


# -- the default model through the gateway ----------------------------------------------------------------------
MODEL = "SmolLM2-135M-Instruct"
COPY = ("Repeat this text exactly: The quick brown fox jumps over the lazy dog. The quick brown fox jumps over "
        "the lazy dog again, and the lazy dog sleeps.")


@pytest.fixture(scope="module")
def gateway(default_model_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("spec-gateway")
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
                       "prompt_lookup_min": 2})
    metrics = free_port()
    with Mesh(default_model_dir, [30], log_dir=logs,
              scheduler_args=("--speculative-config", spec, "--metrics-port", str(metrics))) as mesh:
        with Router(default_model_dir, [mesh.address], log_dir=logs) as router:
            router.scheduler_metrics = f"http://127.0.0.1:{metrics}/metrics"
            yield router


def test_the_gateway_answers_as_transformers_with_prompt_lookup(gateway, default_model_dir):
    import torch
    from transformers import AutoTokenizer

    client = gateway.client()
    texts = [COPY, "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):"]
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    ref = reference_model(default_model_dir)
    for text in texts:
        out = client.completions.create(model=MODEL, prompt=text, max_tokens=40, temperature=0, logprobs=1,
                                        extra_body={"return_token_ids": True, "ignore_eos": True})
        ids = tokenizer(text)["input_ids"]
        with torch.inference_mode():
            want = ref.generate(torch.tensor([ids]), max_new_tokens=40, do_sample=False, min_new_tokens=40,
                                pad_token_id=tokenizer.eos_token_id)[0, len(ids):].tolist()
        choice = out.choices[0]
        assert choice.model_extra["token_ids"] == want
        assert len(choice.logprobs.token_logprobs) == 40
    streamed = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": COPY}],
                                              max_tokens=48, temperature=0, stream=True)
    whole = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": COPY}],
                                           max_tokens=48, temperature=0)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == \
        whole.choices[0].message.content
    assert "quick brown fox" in whole.choices[0].message.content
    deadline, page = time.monotonic() + 10, ""
    while time.monotonic() < deadline:  # the router reads the scheduler's counters every second
        page = requests.get(f"{gateway.base_url}/metrics", timeout=5).text
        accepted = [float(line.split()[-1]) for line in page.splitlines()
                    if line.startswith("vllm:spec_decode_num_accepted_tokens_total{")]
        if accepted and accepted[0] > 0:
            break
        time.sleep(0.5)
    assert accepted and accepted[0] > 0, page[-2000:]
    assert 'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="SmolLM2-135M-Instruct",' \
           'position="0"}' in page
    # each of the four families declared has samples, with data, on the gateway's page and the scheduler's
    for prefix, text in (("vllm", page), ("stagemesh", requests.get(gateway.scheduler_metrics, timeout=5).text)):
        declared = {line.split()[2].removesuffix("_total") for line in text.splitlines()
                    if line.startswith("# TYPE ") and line.endswith(" counter") and "spec_decode" in line}
        assert declared == {f"{prefix}:spec_decode_num_{name}" for name in SPEC_FAMILIES}, declared
        for family in declared:
            values = [float(line.split()[-1]) for line in text.splitlines()
                      if line.startswith((family + "_total{", family + "_total "))]
            assert values and sum(values) > 0, (family, values)


SPEC_FAMILIES = ("drafts", "draft_tokens", "accepted_tokens", "accepted_tokens_per_pos")
