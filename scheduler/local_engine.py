"""The whole replica in one process: the scheduler driving stage runners directly.

No gRPC, no processes: used by `stagemesh generate`, benchmarks and tests,
and the reference the mesh must agree with.
"""
from __future__ import annotations

import itertools
from pathlib import Path

from scheduler.config import SchedulerConfig
from scheduler.request import RequestOutput
from scheduler.scheduler import Scheduler
from stagemesh.model_config import ModelConfig, layer_ranges, layer_split
from stagemesh.sampling_params import SamplingParams
from stage_worker.kv_cache import num_kv_blocks_for_budget
from stage_worker.runner import StageRunner

DEFAULT_KV_BUDGET = 512 * 2**20  # bytes per stage when nothing is said


class LocalEngine:
    def __init__(self, model_dir: str | Path, *, split: list[int] | None = None, block_size: int = 16,
                 num_kv_blocks: int | None = None, kv_cache_memory: int = DEFAULT_KV_BUDGET,
                 max_num_seqs: int = 256, max_num_batched_tokens: int = 2048, enable_prefix_caching: bool = True,
                 max_model_len: int | None = None, device: str = "cpu", dtype: str | None = None):
        cfg = ModelConfig.from_path(model_dir)
        split = split or layer_split(cfg.num_hidden_layers, 1)
        self.runners = [StageRunner(model_dir, a, b, device=device, dtype=dtype, block_size=block_size, config=cfg)
                        for a, b in layer_ranges(split)]
        if num_kv_blocks is None:
            num_kv_blocks = min(num_kv_blocks_for_budget(kv_cache_memory, r.kv_bytes_per_block) for r in self.runners)
        for runner in self.runners:
            runner.allocate_kv_cache(num_kv_blocks)
        self.scheduler = Scheduler(SchedulerConfig(
            num_kv_blocks=num_kv_blocks, block_size=block_size, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, enable_prefix_caching=enable_prefix_caching,
            max_model_len=min(max_model_len or cfg.max_position_embeddings, num_kv_blocks * block_size),
            eos_token_ids=cfg.eos_token_ids))
        self._ids = itertools.count()

    def add_request(self, prompt_token_ids: list[int], sampling: SamplingParams, request_id: str | None = None) -> str:
        request_id = request_id or f"req-{next(self._ids)}"
        self.scheduler.add_request(request_id, prompt_token_ids, sampling)
        return request_id

    def step(self) -> list[RequestOutput]:
        output = self.scheduler.schedule()
        if output is None:
            return []
        hidden = None
        for runner in self.runners:
            result = runner.execute(output.step_batch, hidden)
            hidden = result.hidden_states
        return self.scheduler.update_from_output(output, result.sampled, result.prompt_logprobs)

    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> list[list[int]]:
        """Token ids generated for each prompt, in order."""
        ids = [self.add_request(p, sampling) for p in prompts]
        tokens: dict[str, list[int]] = {i: [] for i in ids}
        while self.scheduler.has_unfinished():
            for out in self.step():
                tokens[out.request_id].extend(out.new_token_ids)
        return [tokens[i] for i in ids]

