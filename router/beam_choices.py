"""Beam search over the replicas: router.beam_search's steps as engine requests of one token with the top 2 x width
logprobs, each prompt's beams pinned to the replica that computed its first step (whose prefix cache then holds
every beam's earlier blocks), and the width best beams of each prompt yielded as its n choices, as router.choices
yields sampled ones. Failover, priority and aborts are router.dispatch's, as for any request."""
from __future__ import annotations

import asyncio
import itertools
from contextlib import aclosing
from dataclasses import replace
from typing import AsyncGenerator

from router.beam_search import Beam, BeamParams, search
from router.dispatch import Generation, dispatch
from router.errors import APIError
from router.generation import Delta
from router.replica_set import ReplicaSet
from router.request import GenerateRequest
from router.tokenization import Tokenizer
from stagemesh.core.sampling_params import SamplingParams


async def run(req: GenerateRequest, gens: list[Generation], replicas: ReplicaSet,
              tokenizer: Tokenizer) -> AsyncGenerator[tuple[Generation, Delta], None]:
    """(choice, its whole answer) for every choice: the beams of each prompt, best first."""
    assert req.beam is not None
    width = req.n
    limits, tenant = req.limits, req.tenant
    ticket = None
    if limits is not None and tenant is not None:  # its tenant's max_concurrency, as router.choices.run counts it
        ticket = await limits.enter(tenant)
    try:
        for p in range(0, len(gens), width):
            group = gens[p:p + width]
            first = group[0]
            eos = tuple(sorted(replicas.eos_token_ids))
            params = BeamParams(width, first.sampling.max_tokens, eos, first.sampling.ignore_eos,
                                req.beam.length_penalty, req.beam.early_stopping, req.include_stop_str_in_output)
            beams = await search(list(first.prompt_ids), params, Steps(first, width, replicas).step)
            for gen, beam in zip(group, beams):
                yield gen, await _delta(req, gen, beam, eos, tokenizer)
    finally:
        if limits is not None and tenant is not None:
            await limits.leave(tenant, ticket)


async def _delta(req: GenerateRequest, gen: Generation, beam: Beam, eos: tuple[int, ...], tokenizer: Tokenizer
                 ) -> Delta:
    tokens = beam.output_token_ids
    shown = tokens[:-1] if tokens and tokens[-1] in eos else tokens  # (an EOS kept in the ids is not text)
    gen.completion_tokens = len(tokens)
    text = await tokenizer.run(tokenizer.decode, shown, req.skip_special_tokens)
    return Delta(text, tokens, [], beam.finish_reason or "length")


class Steps:
    """One prompt's beam search steps: each running beam's tokens as a prompt of its own, on the replica the
    first step ran on."""

    def __init__(self, first: Generation, width: int, replicas: ReplicaSet):
        self.template = replace(first.request, resumable=False, generated_token_ids=())
        self.sampling = SamplingParams(max_tokens=1, logprobs=min(2 * width, 20), ignore_eos=True)
        self.replicas, self.pin = replicas, first.pin
        self.ids = itertools.count()

    async def step(self, prefixes: list[list[int]]) -> list[list[tuple[int, float]]]:
        gens = [Generation(replace(self.template, request_id=f"{self.template.request_id}-beam-{next(self.ids)}",
                                   prompt_token_ids=prefix, sampling=self.sampling), pin=self.pin)
                for prefix in prefixes]
        tasks = [asyncio.create_task(self._one(gen)) for gen in gens]
        try:
            out = list(await asyncio.gather(*tasks))
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        if self.pin is None:
            self.pin = gens[0].replica
        return out

    async def _one(self, gen: Generation) -> list[tuple[int, float]]:
        async with aclosing(dispatch(gen, self.replicas)) as replies:
            async for reply in replies:
                if reply.logprobs:
                    e = reply.logprobs[0]
                    return list(zip(e.top_token_ids, e.top_logprobs))
                if reply.finish_reason is not None:
                    break
        raise APIError(500, f"beam search step {gen.request_id} ended without its logprobs")
