"""The pipeline as stage slices in this process: no gRPC, no processes, one step at a time.

A step runs through the runners in order when it is sent (the hidden states
of one are the input of the next); a step scheduled ahead of its sequences'
last tokens (async scheduling) takes them from the last runner, which sampled
them in the step before. Used by `LocalEngine` (so `stagemesh generate`,
benchmarks and the parity tests run the replica's own driver) and by the
driver's unit tests.
"""
from __future__ import annotations

import asyncio
from contextlib import nullcontext

from scheduler.pipeline import StageFailure, StepResult
from scheduler.rendezvous import ModelIdentity, PipelinePlan, StageInfo
from stagemesh.core.errors import StagemeshError
from stagemesh.core.sampling_params import StructuredOutputs
from stagemesh.core.step import StepBatch
from stage_worker.kv_cache import kv_cache_dtype_name
from stage_worker.kv_tiers import KVTierStore, open_disk_tier
from stage_worker.moe import uncounted
from stage_worker.runner import StageRunner


class InProcessPipeline:
    overlaps_stages = False
    kv_read_key = b""  # (no stage services: no KV is handed out)

    def __init__(self, runners: list[StageRunner], num_kv_blocks: int, kv_disk_path: str | None = None):
        """kv_disk_path: the stages' disk KV tier (each its own namespace directory under it)."""
        self.runners = runners
        disks = [open_disk_tier(kv_disk_path, r) for r in runners] if kv_disk_path else None
        self._disk_dirs = [ns for ns, _ in disks] if disks else []
        self.tiers = [KVTierStore(r, disks[i][1] if disks else None) for i, r in enumerate(runners)]
        self.kv_bytes_per_block = sum(r.kv_bytes_per_block for r in runners)  # a block over every stage
        self.has_disk_tier = kv_disk_path is not None
        self.disk_block_hashes: list[int] = []  # what every stage's disk tier holds, as of the last join
        self.block_size, self.num_stages = runners[0].block_size, len(runners)
        c = runners[0].config
        model = ModelIdentity(c.model_type, c.num_hidden_layers, c.hidden_size, c.vocab_size, c.num_attention_heads,
                              c.num_key_value_heads)
        self.stages = [StageInfo(i, r.model.layer_start, r.model.layer_end, 1, str(r.device), num_kv_blocks,
                                 self.block_size, model, "in-process", "in-process",
                                 kv_bytes_per_block=r.kv_bytes_per_block, kv_disk_tier=self.has_disk_tier,
                                 kv_cache_dtype=kv_cache_dtype_name(r.kv_cache_dtype),
                                 kv_group_windows=r.kv_groups.windows)
                       for i, r in enumerate(runners)]
        self.plan = PipelinePlan(self.stages, len(runners), list(range(len(runners))), [1] * len(runners),
                                 num_kv_blocks, kv_group_windows=runners[0].kv_groups.windows)

    def layout(self) -> PipelinePlan:
        return self.plan

    async def join(self, epoch: int, plan: PipelinePlan, max_model_len: int, max_num_batched_tokens: int) -> None:
        for runner, tiers in zip(self.runners, self.tiers):  # a new epoch starts from empty state, as a stage does
            runner.reset(plan.num_kv_blocks)
            tiers.resize(plan.num_host_kv_blocks)
        self.disk_block_hashes = _common([t.disk_hashes() for t in self.tiers])

    async def store_kv(self, epoch: int, block_ids: list[int], host_slots: list[int], hashes: list[int],
                       to_disk: list[bool], disk_evictions: list[int]) -> None:
        """KV tiers: every stage copies the blocks into its host tier (and queues the disk writes)."""
        for tiers in self.tiers:
            tiers.store(block_ids, host_slots, hashes, to_disk, disk_evictions)

    async def load_kv(self, epoch: int, block_ids: list[int], host_slots: list[int], hashes: list[int]
                      ) -> list[bool]:
        """KV tiers: the blocks every stage can load are filled (files read off the event loop); their flags."""
        reads = [await asyncio.to_thread(t.read, host_slots, hashes) for t in self.tiers]
        ok = [all(flags) for flags in zip(*(t.ready(host_slots, hashes, r) for t, r in zip(self.tiers, reads)))]
        for tiers, r in zip(self.tiers, reads):
            tiers.fill(block_ids, host_slots, r, ok)
        return ok

    async def compile_grammar(self, structured: StructuredOutputs, timeout_s: float) -> None:
        """The last runner's sampler compiles it (in its compile thread) and keeps it for the sequence."""
        sampler = self.runners[-1].sampler
        assert sampler is not None  # (the last runner samples)
        await asyncio.wait_for(asyncio.wrap_future(sampler.prepare(structured)), timeout_s)

    async def pull_kv(self, epoch: int, pull, timeout_s: float) -> int:
        """Disaggregated prefill: no stage service here to fetch a prefill replica's KV with, so the pull fails
        (the kv_load_failure_policy decides), as the Pipeline protocol says."""
        raise StagemeshError("an in-process pipeline cannot pull KV from a prefill replica")

    async def release_kv(self, source, timeout_s: float | None = None) -> bool | None:
        """Not asked (no KV is ever pulled here): None, as for a prefill replica that did not answer."""
        return None

    def forward(self, epoch: int, batch: StepBatch, span, trace_links: list[str]) -> asyncio.Future:
        done = asyncio.get_running_loop().create_future()
        try:
            done.set_result(self._run(batch))
        except StageFailure as err:
            done.set_exception(err)
        return done

    def _run(self, batch: StepBatch) -> StepResult:
        first, last = self.runners[0], self.runners[-1]
        hidden, result = None, None
        for stage, runner in zip(self.stages, self.runners):
            try:
                if runner is first and batch.chunks.has_placeholders():
                    assert last.sampler is not None  # (the last stage's runner samples)
                    batch.chunks.fill_placeholders(last.sampler.last_tokens(batch))
                with uncounted(runner.model) if batch.warmup else nullcontext():
                    result = runner.execute(batch, hidden)
            except StagemeshError as err:
                raise StageFailure(stage, str(err)) from None
            except Exception as err:  # a bug: the step fails as a stage service's would, the loop goes on
                raise StageFailure(stage, f"internal error: {type(err).__name__}: {err}") from err
            hidden = result.hidden_states
        assert result is not None  # (a pipeline has at least one stage)
        return StepResult(result.sampled, result.prompt_logprobs, drafts=result.drafts)

    async def probe(self) -> StageFailure | None:
        return None


def _common(per_stage: list[list[int]]) -> list[int]:
    """The hashes every stage holds, in the first stage's order."""
    others = [set(h) for h in per_stage[1:]]
    return [h for h in per_stage[0] if all(h in o for o in others)] if per_stage else []
