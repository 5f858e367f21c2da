"""Pooling requests through the replicas: inputs tokenized and checked against the context as vLLM checks them,
each prompt sent as an engine request whose sampling carries its PoolingParams (the last stage pools it instead
of sampling), their pooled outputs gathered. Through router.dispatch, so a pooling request goes on on another
replica when its own fails, as a generation does."""
from __future__ import annotations

import asyncio
from contextlib import aclosing
from dataclasses import dataclass

from router.dispatch import Generation, dispatch
from router.errors import APIError, bad_request
from router.replica_set import ReplicaSet
from router.tenants import Tenant
from router.tokenization import Tokenizer
from stagemesh.core.engine_request import EngineRequest
from stagemesh.core.pooling import Pooled, PoolingParams
from stagemesh.core.sampling_params import SamplingParams


@dataclass
class PoolingJob:
    """What one pooling call runs: its id, its prompts' token ids, and what every one of them carries."""
    request_id: str
    prompts: list[list[int]]
    params: PoolingParams
    priority: int = 0
    tenant: Tenant | None = None  # who sent it (router.tenants): the schedulers' fair share weighs it


async def run(job: PoolingJob, replicas: ReplicaSet) -> list[Pooled]:
    """Every prompt's pooled output, in order; the first error ends them all (the others are aborted)."""
    sampling = SamplingParams(max_tokens=1, pooling=job.params)
    tenant, weight = (job.tenant.name, job.tenant.weight) if job.tenant is not None else ("", 1.0)
    single = len(job.prompts) == 1
    gens = [Generation(EngineRequest(job.request_id if single else f"{job.request_id}-{i}", ids, sampling,
                                     priority=job.priority, tenant=tenant, tenant_weight=weight), i)
            for i, ids in enumerate(job.prompts)]
    tasks = [asyncio.create_task(_one(gen, replicas)) for gen in gens]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()  # (after an error: closes each dispatch, which aborts its request in the scheduler)
        await asyncio.gather(*tasks, return_exceptions=True)


async def _one(gen: Generation, replicas: ReplicaSet) -> Pooled:
    async with aclosing(dispatch(gen, replicas)) as replies:
        async for reply in replies:
            if reply.pooled is not None:
                return reply.pooled
            if reply.finish_reason is not None:
                break
    raise APIError(500, f"request {gen.request_id} ended without its pooled output (is the replica run with "
                        "--runner pooling?)")


async def tokenize(inputs, tokenizer: Tokenizer, add_special_tokens: bool, param: str = "input") -> list[list[int]]:
    """Each input as token ids: a text, texts, token ids, or lists of token ids (OpenAI's embeddings input)."""
    if isinstance(inputs, str):
        inputs = [inputs]
    elif inputs and all(isinstance(t, int) for t in inputs):
        inputs = [inputs]
    if not inputs:
        raise bad_request(f"'{param}' must not be empty", param)
    out = []
    for item in inputs:
        if isinstance(item, str):
            tokenizer.check_length(len(item), param)
            out.append(await tokenizer.run(tokenizer.encode, item, add_special_tokens))
        else:
            bad = [t for t in item if not 0 <= t < tokenizer.vocab_size]
            if bad:
                raise bad_request(f"token id {bad[0]} is outside the vocabulary of {tokenizer.vocab_size}", param)
            out.append(list(item))
    return out


def fit(prompts: list[list[int]], max_model_len: int, truncate_prompt_tokens: int | None, side: str = "left"
        ) -> list[list[int]]:
    """truncate_prompt_tokens (-1: max_model_len; the last N tokens, or with `side` right the first N), then
    vLLM's 400 for an input past the context, in its words (vLLM 0.32's renderer); an empty input is refused."""
    if truncate_prompt_tokens is not None:
        k = max_model_len if truncate_prompt_tokens == -1 else truncate_prompt_tokens
        if k > max_model_len:
            raise bad_request(f"truncate_prompt_tokens={k} cannot be greater than max_model_len = {max_model_len}. "
                              "Please request a smaller truncation size.", "truncate_prompt_tokens")
        if k < 1:
            raise bad_request("truncate_prompt_tokens must be -1 or at least 1", "truncate_prompt_tokens")
        prompts = [ids[-k:] if side == "left" else ids[:k] for ids in prompts]
    for ids in prompts:
        if not ids:
            raise bad_request("an input has no tokens", "input")
        if len(ids) > max_model_len:
            raise bad_request(f"This model's maximum context length is {max_model_len} tokens. However, your prompt "
                              f"contains {len(ids)} input tokens, which exceeds this limit even without any output "
                              "tokens. Please reduce the length of the input prompt.", "input_tokens")
    return prompts
