"""Prompt logprobs as lm-evaluation-harness scores multiple choice: its own client (`local-completions`,
batches of 4) and its request shapes (echo + logprobs, max_tokens 0 and 1) give each prompt token the
logprob transformers gives it (atol 1e-4), at PP=1, PP=2 with async scheduling, and TP=2 under preemption."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
import torch

from mesh import Mesh, Router
from parity import prompts as random_prompts
from tiny_models import reference_model, reference_tokens, with_word_tokenizer

pytestmark = pytest.mark.slow
M = "llama-tiny"
CASES = [("w5 w6 w7 w8", " w9 w10"), ("w100 w200", " w33"), ("w17 " * 40, " w3 w4 w5"), ("w300", " w301 w302 w9"),
         ("w8 w9 w10 w11 w12 w13", " w14"), ("w50 w60", " w70 w80 w90")]
LAYOUTS = {
    "pp1": dict(split=[4]),
    "pp2-async": dict(split=[2, 2], handoff="nccl", scheduler_args=("--async-scheduling",)),
    # 16 KV blocks of 16 tokens (8 KiB each at TP=2): four 80-token requests at once must preempt
    "tp2-preemption": dict(split=[4], tp=[2], handoff="nccl", stage_args=("--kv-cache-memory", str(16 * 8192)),
                           scheduler_args=("--max-num-batched-tokens", "64")),
}


@pytest.fixture(scope="module")
def model(tiny_model_dir, tmp_path_factory):
    return with_word_tokenizer(tiny_model_dir("llama"), tmp_path_factory.mktemp("lm-eval") / "model")


@pytest.fixture(scope="module")
def reference(model):
    return reference_model(model)


@pytest.fixture(scope="module", params=list(LAYOUTS))
def router(request, model, tmp_path_factory):
    logs = tmp_path_factory.mktemp(request.param)
    with Mesh(model, log_dir=logs, **LAYOUTS[request.param]) as mesh:
        with Router(model, [mesh.address], ("--served-model-name", M), log_dir=logs) as r:
            r.logs = logs
            yield r


def transformers_logprobs(reference, ids: list[int]) -> torch.Tensor:
    """Each token's logprob given the ones before it (the first has none)."""
    with torch.inference_mode():
        logits = reference(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, -1)[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]


def test_lm_eval_local_completions_scores_like_transformers(router, model, reference):
    from lm_eval.api.instance import Instance
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    lm = LocalCompletionsAPI(model=M, base_url=f"{router.base_url}/v1/completions", tokenizer=str(model),
                             tokenizer_backend="huggingface", batch_size=4, max_length=512, max_retries=1)
    got = lm.loglikelihood([Instance("loglikelihood", {}, (ctx, cont), i) for i, (ctx, cont) in enumerate(CASES)],
                           disable_tqdm=True)
    for (ctx, cont), (logprob, _) in zip(CASES, got):
        context, continuation = lm._encode_pair(ctx, cont)
        want = transformers_logprobs(reference, context + continuation)[len(context) - 1:].sum()
        assert logprob == pytest.approx(float(want), abs=1e-4 * len(continuation)), (ctx, cont)


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_echo_with_logprobs_gives_every_prompt_token_its_logprob(router, reference, max_tokens):
    prompts = [[5, 6, 7, 8, 9], list(range(20, 90)), [300, 301]]
    body = {"model": M, "prompt": prompts, "echo": True, "logprobs": 2, "max_tokens": max_tokens, "temperature": 0}
    answer = requests.post(f"{router.base_url}/v1/completions", json=body, timeout=120).json()
    choices = sorted(answer["choices"], key=lambda c: c["index"])
    assert [c["index"] for c in choices] == [0, 1, 2]
    for prompt, choice in zip(prompts, choices):
        lp = choice["logprobs"]
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert len(lp["tokens"]) == len(prompt) + max_tokens
        got = torch.tensor(lp["token_logprobs"][1:len(prompt)])
        torch.testing.assert_close(got, transformers_logprobs(reference, prompt), atol=1e-4, rtol=0)
        assert all(len(top) <= 3 for top in lp["top_logprobs"][1:])  # top 2, and the token itself
        scored = choice["prompt_logprobs"]  # vLLM's field: token id -> logprob, rank, decoded token
        assert scored[0] is None and len(scored) == len(prompt)
        for i, entry in enumerate(scored[1:], start=1):
            assert entry[str(prompt[i])]["logprob"] == pytest.approx(lp["token_logprobs"][i], abs=1e-6)
    assert answer["usage"]["prompt_tokens"] == sum(map(len, prompts))
    assert answer["usage"]["completion_tokens"] == 3 * max_tokens


def test_scored_prompts_and_their_tokens_survive_preemption(router, reference, request):
    """Four requests that each score their prompt and generate: transformers' prompt logprobs (each once,
    whether or not the request was preempted and recomputed) and greedy tokens."""
    prompts = random_prompts(384, lengths=(40, 41, 42, 43), seed=5)

    def ask(prompt):
        body = {"model": M, "prompt": prompt, "max_tokens": 40, "temperature": 0, "ignore_eos": True,
                "prompt_logprobs": 0, "return_token_ids": True}
        return requests.post(f"{router.base_url}/v1/completions", json=body, timeout=180).json()["choices"][0]

    with ThreadPoolExecutor(4) as pool:
        choices = list(pool.map(ask, prompts))
    for prompt, choice in zip(prompts, choices):
        scored = choice["prompt_logprobs"]
        assert len(scored) == len(prompt) and scored[0] is None
        got = torch.tensor([scored[i][str(prompt[i])]["logprob"] for i in range(1, len(prompt))])
        torch.testing.assert_close(got, transformers_logprobs(reference, prompt), atol=1e-4, rtol=0)
        assert choice["token_ids"] == reference_tokens(reference, prompt, 40)
    metrics = requests.get(f"{router.base_url}/metrics", timeout=10).text
    preempted = sum(float(line.split()[-1]) for line in metrics.splitlines()
                    if line.startswith("vllm:num_preemptions_total{"))
    if "preemption" in request.node.callspec.id:
        assert preempted > 0, "the layout meant to preempt did not"
