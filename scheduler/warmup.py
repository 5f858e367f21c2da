"""Warm before ready: a few dummy steps through a newly formed pipeline before the replica says it can serve, as
vLLM runs its profile and warm-up forwards before its server opens.

The first step of a cold pipeline pays for what is made on first use: each stage's layer plans and kernels,
its sampler and prompt-logprob paths, the channels and handoff between stages, the TP followers' first
messages. Without this the first request after a start took 2x the second (issue 58). The warm-up runs two
requests of its own (a prefill of up to WARMUP_PROMPT_TOKENS tokens each, then a few decode steps at batch 2;
one greedy with logprobs and prompt logprobs, one sampled with top-k / top-p) on a scheduler of its own, with
no prefix caching and no tiers: nothing it computes is ever found by a request, and the replica's own
scheduler starts empty. Their sequence ids stay spent in this epoch (scheduler.handover.continue_after), and the
stages drop them with the real scheduler's first step.
"""
from __future__ import annotations

import logging
import time
from dataclasses import replace

from scheduler.config import SchedulerConfig
from scheduler.pipeline import Pipeline, check_result
from scheduler.scheduler import Scheduler
from stagemesh.core.engine_request import EngineRequest
from stagemesh.core.errors import StagemeshError
from stagemesh.core.pooling import PoolingParams
from stagemesh.core.sampling_params import InvalidParameter, SamplingParams, StructuredOutputs

log = logging.getLogger("stagemesh.scheduler")
WARMUP_PROMPT_TOKENS = 256  # each warm-up prompt's length at most (and within the step's token budget)
WARMUP_OUTPUT_TOKENS = 4
MAX_WARMUP_STEPS = 64  # a bound on the loop (two prompts and their outputs take a handful)
# the last stage's constraint compiler is made once (the tokenizer's vocabulary indexed: seconds on a busy CPU);
# made before serving, the first structured request's --grammar-compile-timeout counts its own compile only
WARMUP_GRAMMAR = StructuredOutputs("regex", "[a-z]+")
WARMUP_COMPILE_S = 120.0


def warmup_requests(config: SchedulerConfig) -> list[EngineRequest]:
    """Two requests that take the model's paths a first real request takes, within the pipeline's limits."""
    # (each request's blocks within half the cache, every KV cache group's, so that both run at once)
    half = replace(config, num_kv_blocks=config.num_kv_blocks // 2).kv_cache_tokens
    room = min(config.max_model_len or 0, half) - WARMUP_OUTPUT_TOKENS
    prompt_len = max(1, min(WARMUP_PROMPT_TOKENS, config.max_num_batched_tokens // 2, room))
    vocab = config.vocab_size or 2
    eos = set(config.eos_token_ids)
    ids = [t for t in range(1, min(vocab, 1024)) if t not in eos] or [0]
    prompt = [ids[(7 * i) % len(ids)] for i in range(prompt_len)]
    greedy = SamplingParams(max_tokens=WARMUP_OUTPUT_TOKENS, min_tokens=WARMUP_OUTPUT_TOKENS, ignore_eos=True,
                            logprobs=1, prompt_logprobs=1)
    sampled = SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=0, max_tokens=WARMUP_OUTPUT_TOKENS,
                             min_tokens=WARMUP_OUTPUT_TOKENS, ignore_eos=True)
    if config.pooling_tasks:  # a pooling replica: its first and last tasks (a sequence pool and a token-wise one)
        tasks = config.pooling_tasks
        return [EngineRequest(f"warmup-{task}", p, SamplingParams(max_tokens=1, pooling=PoolingParams(task)))
                for task, p in ((tasks[0], prompt), (tasks[-1], prompt[::-1]))]
    return [EngineRequest("warmup-greedy", prompt, greedy), EngineRequest("warmup-sampled", prompt[::-1], sampled)]


async def warm_up(pipeline: Pipeline, epoch: int, config: SchedulerConfig) -> Scheduler:
    """Run the warm-up requests through `pipeline` in `epoch`, one step at a time; returns the scheduler that
    ran them (the replica's scheduler continues after it). Raises StageFailure as a step does."""
    start = time.perf_counter()
    warm = Scheduler(replace(config, enable_prefix_caching=False, num_host_kv_blocks=0, num_disk_kv_blocks=0,
                             async_scheduling=False, max_waiting_requests=0, lora=None))
    requests = warmup_requests(warm.config)
    try:
        for request in requests:
            warm.add_request(request)
    except StagemeshError as err:  # (a context too short for any prompt and output)
        log.warning("no warm-up: %s", err)
        warm.fail_all("no warm-up")
        return warm
    steps = 0
    while warm.has_unfinished() and steps < MAX_WARMUP_STEPS:
        output = warm.schedule()
        if output is None:
            break
        output.step_batch.warmup = True
        result = await pipeline.forward(epoch, output.step_batch, None, [])
        # (the warm-up's prompts are arbitrary tokens: one the model answers with non-finite logits fails its
        # sequence, as it fails a request; the steps still warmed the paths, and serving decides per request)
        check_result(output.step_batch, result, config.vocab_size, all_failed_is_fault=False)
        failed = [t.error for t in result.sampled if t.error is not None]
        if failed:
            log.warning("warm-up: %d sequence(s) failed to sample (%s); the model fails some inputs", len(failed),
                        failed[0])
        warm.update_from_output(output, result.sampled, result.prompt_logprobs, result.drafts)
        steps += 1
    if warm.has_unfinished():  # (not expected: the requests fit the pipeline by construction)
        log.warning("warm-up: %d request(s) did not finish in %d steps; serving anyway", warm.num_unfinished, steps)
        warm.fail_all("warm-up ended")
    if config.pooling_tasks:  # (a pooling pipeline samples nothing: no constraint to compile)
        log.info("warm-up: %d steps (2 prompts of %d tokens, pooled) in %.2fs before serving", steps,
                 len(requests[0].prompt_token_ids), time.perf_counter() - start)
        return warm
    await _warm_grammar(pipeline)
    log.info("warm-up: %d steps (2 prompts of %d tokens, then decode at batch 2) and a constraint's compile in "
             "%.2fs before serving", steps, len(requests[0].prompt_token_ids), time.perf_counter() - start)
    return warm


async def _warm_grammar(pipeline: Pipeline) -> None:
    try:
        await pipeline.compile_grammar(WARMUP_GRAMMAR, WARMUP_COMPILE_S)
    except TimeoutError:
        log.warning("warm-up: the last stage did not compile a constraint in %gs; serving anyway", WARMUP_COMPILE_S)
    except (InvalidParameter, StagemeshError) as err:  # (a model without a tokenizer compiles none)
        log.info("warm-up: no constraint compiled (%s)", err)
