"""A request's choices (each prompt x n) run as sequences of their own, their deltas merged as they come.

Parallel sampling (n > 1) computes a prompt once: the first sequence of a prompt goes out alone, and
its siblings follow once its prompt is computed (its first output), pinned to its replica, where the
prefix cache holds the prompt's full blocks. Sibling i samples with the request's seed + i (as vLLM),
so choice i equals a single request with that seed. Prompt logprobs are computed by the first only.

Each choice's engine request (stagemesh.core.engine_request) is built here, once its max_tokens is
settled (fit_max_tokens); every layer below takes it whole.
"""
from __future__ import annotations

import asyncio
from contextlib import aclosing
from dataclasses import replace
from typing import AsyncGenerator

from router.errors import bad_request
from router.dispatch import Generation
from router.generation import Delta, generate
from router.observe import group_done
from router.replica_set import ReplicaSet
from router.request import GenerateRequest
from router.tokenization import Tokenizer
from stagemesh.core import telemetry
from stagemesh.core.sampling_params import INT64_MIN, SamplingParams


def plan(req: GenerateRequest, prompts: list[list[int]], base_id: str, max_model_len: int) -> list[Generation]:
    """One Generation per choice, in OpenAI's order: choice index = prompt index x n + i. Each one's engine
    request is built here, once, after its max_tokens is settled (fit_max_tokens), from the per-request fields
    the request builder gathered (req.engine) and the caller's trace context."""
    gens, single = [], len(prompts) * req.n == 1
    trace = dict(telemetry.inject())
    template = replace(req.engine, resumable=req.resumable or req.resume is not None,
                       traceparent=trace.get("traceparent", ""), tracestate=trace.get("tracestate", ""))
    for p, ids in enumerate(prompts):
        sampling = fit_max_tokens(req, req.sampling, len(ids), max_model_len)
        for i in range(req.n):
            child = sampling if i == 0 else replace(sampling, prompt_logprobs=None,
                                                    seed=_sibling_seed(sampling.seed, i))
            index = p * req.n + i
            request = replace(template, request_id=base_id if single else f"{base_id}-{index}", prompt_token_ids=ids,
                              sampling=child)
            gens.append(Generation(request, index, sibling=i > 0,
                                   resume_from=None if req.resume is None else req.resume.tokens[index]))
    return gens


def fit_max_tokens(req: GenerateRequest, sampling: SamplingParams, prompt_len: int, max_model_len: int
                   ) -> SamplingParams:
    """The one place max_tokens is settled, per prompt, before its engine request is built (router.choices.plan):
    the most tokens a choice generates, at least 1. Not given (HTTP: absent or null; the gRPC frontend: 0) it is
    the model's default (its generation config's max_new_tokens) within the room the context leaves after the
    prompt, else that room, as vLLM's; until here the request builder holds the largest value, so that min_tokens
    is checked against that room. What cannot fit is refused with vLLM's words and params: the prompt
    ('input_tokens'), or the max_tokens field itself when it alone passes the context. Given or not, the model's
    cap (vLLM's override_max_tokens) bounds it last."""
    param = req.max_tokens_param
    if not req.max_tokens_given:
        room = max_model_len - prompt_len
        if room < 1:
            raise bad_request(f"You passed {prompt_len} input tokens, which leaves no room for output tokens: the "
                              f"model's context length is only {max_model_len} tokens. Please reduce the length of "
                              "the input prompt.", "input_tokens")
        if req.echo_only:
            return sampling
        return _with_max_tokens(sampling, min(v for v in (room, req.max_tokens_default, req.max_tokens_cap)
                                              if v is not None))
    asked = sampling.max_tokens
    if asked > max_model_len:
        raise bad_request(f"{param}={asked} cannot be greater than max_model_len={max_model_len}. Please request "
                          "fewer output tokens.", param)
    if prompt_len + asked > max_model_len:
        raise bad_request(f"You passed {prompt_len} input tokens and requested {asked} output tokens. However, the "
                          f"model's context length is only {max_model_len} tokens, resulting in a maximum input "
                          f"length of {max_model_len - asked} tokens. Please reduce the length of the input "
                          "prompt.", "input_tokens")
    if req.max_tokens_cap is not None and asked > req.max_tokens_cap:
        return _with_max_tokens(sampling, req.max_tokens_cap)
    return sampling


def _with_max_tokens(sampling: SamplingParams, max_tokens: int) -> SamplingParams:
    if sampling.min_tokens > max_tokens:  # (vLLM's words, with max_tokens what it settled on)
        raise bad_request(f"min_tokens must be less than or equal to max_tokens={max_tokens}, got "
                          f"{sampling.min_tokens}.", "min_tokens")
    return replace(sampling, max_tokens=max_tokens)


def _sibling_seed(seed: int | None, i: int) -> int | None:
    """Choice i's seed: the request's + i, wrapping around int64 as the wire's integer does (a seed near its
    top with n > 1 is a request like any other, not an overflow)."""
    return None if seed is None else (seed + i - INT64_MIN) % 2**64 + INT64_MIN


async def run(req: GenerateRequest, gens: list[Generation], replicas: ReplicaSet,
              tokenizer: Tokenizer) -> AsyncGenerator[tuple[Generation, Delta], None]:
    """(choice, delta) as they come, from every choice, until each has finished. The first error ends it
    all (the other choices are aborted)."""
    limits, tenant = req.limits, req.tenant
    ticket = None
    if limits is not None and tenant is not None:  # (the 429 at max_concurrency: nothing started yet)
        ticket = await limits.enter(tenant)
    if len(gens) == 1:  # one choice (most requests): its deltas straight through, no task and queue per token
        try:
            async with aclosing(generate(req, gens[0], replicas, tokenizer)) as deltas:
                async for delta in deltas:
                    yield gens[0], delta
            _count_groups(req, gens)
        finally:
            gens[0].release()  # (as below)
            if limits is not None and tenant is not None:
                await limits.leave(tenant, ticket)
        return
    queue: asyncio.Queue = asyncio.Queue()
    firsts: dict[tuple[int, ...], Generation] = {}
    for gen in gens:
        firsts.setdefault(tuple(gen.prompt_ids), gen)

    async def one(gen: Generation) -> None:
        first = firsts[tuple(gen.prompt_ids)]
        if first is not gen and gen.resume_from is None:  # a sibling waits for its prompt to be computed, then
            # runs where it was (a resumed one runs where it ran)
            await first.started.wait()
            gen.pin = first.replica
        async with aclosing(generate(req, gen, replicas, tokenizer)) as deltas:
            async for delta in deltas:
                queue.put_nowait((gen, delta))

    tasks = [asyncio.create_task(one(gen)) for gen in gens]
    for task in tasks:
        task.add_done_callback(lambda t: queue.put_nowait(t))
    try:
        running = len(tasks)
        while running:
            item = await queue.get()
            if isinstance(item, asyncio.Task):
                running -= 1
                if not item.cancelled() and (err := item.exception()) is not None:
                    raise err
                continue
            yield item
        _count_groups(req, gens)
    finally:
        for task in tasks:
            task.cancel()  # closes each generation, which aborts its request in the scheduler
        await asyncio.gather(*tasks, return_exceptions=True)
        for gen in gens:  # the answer is written (or abandoned): the replicas may forget what they kept
            gen.release()
        if limits is not None and tenant is not None:
            await limits.leave(tenant, ticket)


def _count_groups(req: GenerateRequest, gens: list[Generation]) -> None:
    """Every choice finished: each prompt's n and the most tokens one of its choices made (vLLM's series)."""
    for p in range(0, len(gens), req.n):
        group = gens[p:p + req.n]
        group_done(req.n, max(g.completion_tokens for g in group), group[0].replica)
