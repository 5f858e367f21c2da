"""What a request must be to enter a scheduler: checks that need the settings only, not the queues.

A request that fails them is refused with one line that says why, before it takes any place.
"""
from __future__ import annotations

from collections.abc import Sequence

from scheduler.config import SchedulerConfig
from stagemesh.core.engine_request import EngineRequest
from stagemesh.core.errors import StagemeshError
from stagemesh.core.kv_groups import FULL
from stagemesh.core.sampling_params import SamplingParams, check_token_ids
from stagemesh.core.step import TokenLogprob

MAX_REQUEST_ID_LEN = 256


def check_engine_request(cfg: SchedulerConfig, r: EngineRequest) -> None:
    """check_request and check_generated_logprobs; its LoRA adapter served here; a prefill_only request with
    nothing that says its prompt was computed elsewhere."""
    check_request(cfg, r.request_id, r.prompt_token_ids, r.sampling, r.generated_token_ids)
    check_generated_logprobs(r.generated_token_ids, r.generated_logprobs, r.sampling)
    if r.lora_name and (cfg.lora is None or r.lora_name not in cfg.lora):
        raise StagemeshError(f"the LoRA adapter {r.lora_name[:200]!r} is not served by this replica"
                             + ("" if cfg.lora is not None else " (it runs without --enable-lora)"))
    if r.prefill_only and (r.kv_source is not None or r.generated_token_ids):
        raise StagemeshError("a prefill_only request computes its own prompt: no kv_transfer or generated "
                             "tokens with it")
    if r.prefill_only and cfg.kv_group_windows != (FULL,):  # (a kv_transfer's KV does not fit: kv_source_fits)
        raise StagemeshError("disaggregated prefill does not carry the hybrid KV cache manager's groups (a block "
                             "table per group of sliding-window layers) yet: start this replica's stages with "
                             "--disable-hybrid-kv-cache-manager (serve does so with --prefill-replicas)")


def check_request(cfg: SchedulerConfig, request_id: str, prompt_token_ids: Sequence[int], sampling: SamplingParams,
                  generated_token_ids: Sequence[int]) -> None:
    """Its id, its token ids against the vocabulary, and prompt + max_tokens against the context length and
    the KV cache (a continuation's generated tokens leave something to generate)."""
    if not request_id or len(request_id) > MAX_REQUEST_ID_LEN:
        raise StagemeshError(f"a request id must have 1 to {MAX_REQUEST_ID_LEN} characters")
    if not prompt_token_ids:
        raise StagemeshError("the prompt is empty")
    check_token_ids("prompt_token_ids", prompt_token_ids, cfg.vocab_size)
    check_token_ids("generated_token_ids", generated_token_ids, cfg.vocab_size)
    if len(generated_token_ids) >= sampling.max_tokens:
        raise StagemeshError(f"a continuation of {len(generated_token_ids)} generated tokens has nothing left "
                             f"to generate (max_tokens {sampling.max_tokens})")
    if cfg.vocab_size is not None:
        sampling.check_vocab(cfg.vocab_size)
    check_runner(cfg.pooling_tasks, sampling)
    total = request_tokens(len(prompt_token_ids), sampling)
    assert cfg.max_model_len is not None  # (a scheduler runs on a formed config: SchedulerConfig.check_formed)
    if total > cfg.max_model_len:
        asked = "" if sampling.pooling is not None else f" + {sampling.max_tokens} max_tokens"
        raise StagemeshError(
            f"this model's maximum context length is {cfg.max_model_len} tokens, but the request asks for "
            f"{total} ({len(prompt_token_ids)} in the prompt{asked})"
        )
    if not cfg.fits_kv_cache(total):
        raise StagemeshError(f"a request of {total} tokens can never fit the KV cache of {cfg.kv_cache_tokens} tokens")


def check_runner(pooling_tasks: tuple[str, ...], sampling: SamplingParams) -> None:
    """A pooling replica pools and a generating one generates: a request for the other is refused here, alone
    (at the last stage it would fail a step)."""
    pooling = sampling.pooling
    if pooling_tasks and pooling is None:
        raise StagemeshError("this replica runs --runner pooling: it pools prompts and generates no tokens")
    if pooling is not None and not pooling_tasks:
        raise StagemeshError("this replica generates (--runner generate): it pools nothing")
    if pooling is not None and pooling.task not in pooling_tasks:
        raise StagemeshError(f"this replica's model does not serve the {pooling.task} task (it serves "
                             f"{', '.join(pooling_tasks)})")


def request_tokens(num_prompt_tokens: int, sampling: SamplingParams) -> int:
    """The positions a request may fill: its prompt and max_tokens; a pooling request's prompt alone (its one
    output is the pool, not a token), so a prompt of max_model_len tokens pools as in vLLM."""
    return num_prompt_tokens + (0 if sampling.pooling is not None else sampling.max_tokens)


def check_generated_logprobs(generated_token_ids: Sequence[int], logprobs: Sequence[TokenLogprob],
                             sampling: SamplingParams) -> None:
    """A continuation's logprobs (kept for a resume only): none, or one per generated token, of that token, with
    at most sampling.logprobs top ones."""
    if not logprobs:
        return
    top = sampling.logprobs if sampling.logprobs is not None else -1
    if len(logprobs) != len(generated_token_ids) or top < 0 or any(
            e.token_id != t or len(e.top_token_ids) != len(e.top_logprobs) or len(e.top_token_ids) > top + 1
            for e, t in zip(logprobs, generated_token_ids)):
        raise StagemeshError(f"a continuation's generated_logprobs must be one per generated token ({len(logprobs)} "
                             f"for {len(generated_token_ids)}), of that token, with at most sampling.logprobs top "
                             "ones (and its own), and only when sampling.logprobs is set")
