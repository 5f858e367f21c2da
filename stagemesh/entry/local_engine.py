"""The whole replica in one process: the replica's driver over stage slices in this process.

No gRPC, no processes: used by `stagemesh generate`, benchmarks and tests, and the
reference the mesh must agree with. It runs the same driver (scheduler.driver) as
a scheduler service, over stagemesh.entry.inprocess_pipeline, on an event loop of its
own that its synchronous methods drive.
"""
from __future__ import annotations

import asyncio
import itertools
import json
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Iterator

from scheduler.config import SchedulerConfig
from scheduler.driver import Driver, DriverConfig
from scheduler.lora_table import LoRATable
from stagemesh.entry.inprocess_pipeline import InProcessPipeline
from scheduler.output_stream import OutputStream
from scheduler.request import RequestOutput
from scheduler.stats import SchedulerStats
from stagemesh.core.engine_request import EngineRequest
from stagemesh.core.errors import StagemeshError
from stagemesh.core.model_config import ModelConfig, layer_ranges, layer_split
from stagemesh.core.sampling_params import SamplingParams
from stagemesh.core.speculative import parse_speculative_config
from stage_worker.draft import make_drafter
from stage_worker.kv_cache import num_kv_blocks_for_budget
from stage_worker.runner import StageRunner
from stage_worker.settings import StageSettings

DEFAULT_KV_BUDGET = 512 * 2**20  # bytes per stage when nothing is said


@dataclass(frozen=True)
class EngineSettings:
    """The in-process engine's settings: its stages' (one StageSettings, its layers each stage's share of
    layer_split) and its scheduler's, each named as the `stagemesh serve` flag it means (num_kv_blocks, which no
    flag sets, overrides the count kv_cache_memory gives)."""
    stage: StageSettings  # every stage's, less its layers (the model, dtype, block size, quantization, LoRA ...)
    layer_split: tuple[int, ...] | None = None  # layers per stage (default: one stage)
    num_kv_blocks: int | None = None
    kv_cache_memory: int = DEFAULT_KV_BUDGET
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    max_model_len: int | None = None
    async_scheduling: bool | None = None
    speculative_config: str | None = None  # vLLM's --speculative-config, JSON
    kv_offloading_disk_path: str | None = None  # the stages' disk KV tier (stagemesh.entry.inprocess_pipeline)


ENGINE_FIELDS = frozenset(f.name for f in fields(EngineSettings)) - {"stage"}


class LocalEngine:
    def __init__(self, settings: EngineSettings):
        s, stage = settings, settings.stage
        self.settings = settings
        cfg = ModelConfig.from_path(stage.model_dir)  # type: ignore[arg-type]
        spec = parse_speculative_config(s.speculative_config)
        split = list(s.layer_split or layer_split(cfg.num_hidden_layers, 1))
        self.runners = [StageRunner(replace(stage, layers=(a, b)), config=cfg) for a, b in layer_ranges(split)]
        if spec is not None and spec.uses_draft_model:  # on the last stage, as a stage service runs it
            self.runners[-1].attach_drafter(make_drafter(spec, cfg, stage.model_dir, stage.device, stage.dtype,
                                                         stage.block_size, stage.load_format))
        num_kv_blocks = s.num_kv_blocks
        if num_kv_blocks is None:
            num_kv_blocks = min(num_kv_blocks_for_budget(s.kv_cache_memory, r.kv_bytes_per_block) for r in self.runners)
        self.pipeline = InProcessPipeline(self.runners, num_kv_blocks, s.kv_offloading_disk_path)
        lora = self.runners[0].lora
        self.driver = Driver(DriverConfig(
            SchedulerConfig(max_model_len=s.max_model_len, block_size=stage.block_size, max_num_seqs=s.max_num_seqs,
                            max_num_batched_tokens=s.max_num_batched_tokens,
                            enable_prefix_caching=s.enable_prefix_caching, eos_token_ids=cfg.eos_token_ids,
                            vocab_size=cfg.vocab_size, speculative=spec,
                            lora=LoRATable(lora.limits.max_loras, lora.limits.max_lora_rank, (),
                                           {m.name: m.path for m in lora.settings.modules}) if lora else None),
            # nothing restarts in-process: a failed step fails its requests at once
            model_max_len=cfg.max_position_embeddings, async_scheduling=s.async_scheduling,
            stage_recovery_timeout_s=0.0), self.pipeline)
        self._loop = asyncio.new_event_loop()
        self._loop.run_until_complete(self.driver.form())
        if not self.driver.healthy:
            raise StagemeshError(self.driver.reason)
        self._running = self._loop.create_task(self.driver.run())
        self._ids = itertools.count()

    @classmethod
    def of(cls, model: str | Path, **flags: Any) -> LocalEngine:
        """An engine from keyword flags: EngineSettings' own, and the stages' (StageSettings.of: LoRA's flat as on
        the command line, and --lora-modules alone turns LoRA on); a dict --speculative-config as JSON."""
        engine = {k: flags.pop(k) for k in list(flags) if k in ENGINE_FIELDS}
        if flags.get("lora_modules") is not None:
            flags.setdefault("enable_lora", True)
        elif "lora_modules" in flags:
            del flags["lora_modules"]
        if isinstance(engine.get("speculative_config"), dict):
            engine["speculative_config"] = json.dumps(engine["speculative_config"])
        if engine.get("layer_split") is not None:
            engine["layer_split"] = tuple(engine["layer_split"])
        return cls(EngineSettings(StageSettings.of(model, 0, 0, **flags), **engine))

    def stream(self, prompt_token_ids: list[int], sampling: SamplingParams,
               request_id: str | None = None, lora_name: str = "") -> Iterator[RequestOutput]:
        """One request's outputs as the steps produce them; raises StagemeshError if it fails."""
        request_id = request_id or f"req-{next(self._ids)}"
        outputs = OutputStream()
        self.driver.add(EngineRequest(request_id, prompt_token_ids, sampling, lora_name=lora_name), outputs)
        try:
            while True:
                out = self._loop.run_until_complete(outputs.get())
                if out.finish_reason == "error":
                    raise StagemeshError(out.error or "the request failed")
                yield out
                if out.finished:
                    return
        finally:
            self.driver.release(request_id)

    def generate(self, prompts: list[list[int]], sampling: SamplingParams | list[SamplingParams],
                 lora_names: list[str] | None = None) -> list[list[int]]:
        """Token ids generated for each prompt, in order (the prompts run as one continuous batch); one
        sampling for all, or one per prompt; lora_names: each prompt's LoRA adapter ("": the base model)."""
        samplings = sampling if isinstance(sampling, list) else [sampling] * len(prompts)
        adapters = lora_names or [""] * len(prompts)

        async def one(prompt: list[int], sampling: SamplingParams, adapter: str) -> list[int]:
            tokens = []
            request = EngineRequest(f"req-{next(self._ids)}", prompt, sampling, lora_name=adapter)
            async for out in self.driver.submit(request):
                if out.finish_reason == "error":
                    raise StagemeshError(out.error or "the request failed")
                tokens += out.new_token_ids
            return tokens

        async def run_all() -> list[list[int]]:
            return list(await asyncio.gather(*map(one, prompts, samplings, adapters)))
        return self._loop.run_until_complete(run_all())

    def stats(self) -> SchedulerStats:
        """The scheduler's counters. Raises StagemeshError once a failed step gave the requests up (nothing
        restarts in-process: the driver has no scheduler then)."""
        scheduler = self.driver.scheduler
        if scheduler is None:
            raise StagemeshError(f"the engine cannot serve: {self.driver.reason}")
        return scheduler.stats()

    def close(self) -> None:
        """Stop the driver and its event loop."""
        if self._loop.is_closed():
            return
        self._running.cancel()
        self._loop.run_until_complete(asyncio.gather(self._running, return_exceptions=True))
        self._loop.run_until_complete(self.driver.close())
        self._loop.close()

    def __enter__(self) -> "LocalEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
