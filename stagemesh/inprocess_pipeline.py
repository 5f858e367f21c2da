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

from scheduler.pipeline import StageFailure, StepResult
from scheduler.rendezvous import ModelIdentity, PipelinePlan, StageInfo
from stagemesh.core.errors import StagemeshError
from stagemesh.core.step import StepBatch
from stage_worker import run_ahead
from stage_worker.runner import StageRunner


class InProcessPipeline:
    overlaps_stages = False

    def __init__(self, runners: list[StageRunner], num_kv_blocks: int):
        self.runners = runners
        self.block_size, self.num_stages = runners[0].block_size, len(runners)
        c = runners[0].config
        model = ModelIdentity(c.model_type, c.num_hidden_layers, c.hidden_size, c.vocab_size, c.num_attention_heads,
                              c.num_key_value_heads)
        self.stages = [StageInfo(i, r.model.layer_start, r.model.layer_end, 1, str(r.device), num_kv_blocks,
                                 self.block_size, model, "in-process", "in-process") for i, r in enumerate(runners)]
        self.plan = PipelinePlan(self.stages, len(runners), list(range(len(runners))), [1] * len(runners),
                                 num_kv_blocks)

    def layout(self) -> PipelinePlan:
        return self.plan

    async def join(self, epoch: int, plan: PipelinePlan, max_model_len: int, max_num_batched_tokens: int) -> None:
        for runner in self.runners:  # a new epoch starts from empty state, as a stage service does
            runner.reset(plan.num_kv_blocks)

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
                if runner is first and run_ahead.has_placeholders(batch):
                    run_ahead.fill(batch, run_ahead.sampled_tokens(last.sampler, batch))
                result = runner.execute(batch, hidden)
            except StagemeshError as err:
                raise StageFailure(stage, str(err)) from None
            except Exception as err:  # a bug: the step fails as a stage service's would, the loop goes on
                raise StageFailure(stage, f"internal error: {type(err).__name__}: {err}") from err
            hidden = result.hidden_states
        return StepResult(result.sampled, result.prompt_logprobs, drafts=result.drafts)

    async def probe(self) -> StageFailure | None:
        return None
