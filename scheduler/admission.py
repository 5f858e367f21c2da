"""What a request must be to enter a scheduler: checks that need the settings only, not the queues.

A request that fails them is refused with one line that says why, before it takes any place.
"""
from __future__ import annotations

from collections.abc import Sequence

from scheduler.config import SchedulerConfig
from stagemesh.core.errors import StagemeshError
from stagemesh.core.sampling_params import SamplingParams, check_token_ids
from stagemesh.core.step import TokenLogprob

MAX_REQUEST_ID_LEN = 256


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
    total = len(prompt_token_ids) + sampling.max_tokens
    assert cfg.max_model_len is not None  # (a scheduler runs on a formed config: SchedulerConfig.check_formed)
    if total > cfg.max_model_len:
        raise StagemeshError(
            f"this model's maximum context length is {cfg.max_model_len} tokens, but the request asks for "
            f"{total} ({len(prompt_token_ids)} in the prompt + {sampling.max_tokens} max_tokens)"
        )
    if not fits_kv_cache(cfg, total):
        raise StagemeshError(f"a request of {total} tokens can never fit the KV cache of {cfg.kv_cache_tokens} tokens")


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


def fits_kv_cache(cfg: SchedulerConfig, num_tokens: int) -> bool:
    return -(-num_tokens // cfg.block_size) <= cfg.num_kv_blocks
