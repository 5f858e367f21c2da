"""What a request must be for a replica to queue it: checked before the scheduler takes it, so that a request
with bad data fails alone (INVALID_ARGUMENT) and nothing of it reaches the stages."""
from __future__ import annotations

from scheduler.config import SchedulerConfig
from stagemesh.core.errors import StagemeshError
from stagemesh.core.sampling_params import SamplingParams, check_token_ids

MAX_REQUEST_ID_LEN = 256


def check_request(cfg: SchedulerConfig, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams,
                  generated_token_ids: list[int]) -> None:
    """Raises StagemeshError (the reason) unless the request can run on a pipeline of this configuration."""
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
    if total > cfg.max_model_len:
        raise StagemeshError(f"this model's maximum context length is {cfg.max_model_len} tokens, but the request "
                             f"asks for {total} ({len(prompt_token_ids)} in the prompt + {sampling.max_tokens} "
                             "max_tokens)")
    if -(-total // cfg.block_size) > cfg.num_kv_blocks:
        raise StagemeshError(f"a request of {total} tokens can never fit the KV cache of {cfg.kv_cache_tokens} tokens")
