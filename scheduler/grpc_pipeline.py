"""The pipeline of stage services: registration, joining an epoch, Forward calls and probes over gRPC.

Stages register with the scheduler (scheduler.rendezvous checks that they tile
the model); once all have, the driver forms an epoch: every stage must answer
as the instance that registered, then all join one torch.distributed world
through the replica's store. A step goes to every stage at once (each takes
its part in step order, scheduling the next before the previous is back); the
last stage's reply carries the sampled tokens. Protobuf stays in this module.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import grpc

from opentelemetry import trace

from scheduler.pipeline import StageFailure, StepResult
from scheduler.rendezvous import PipelinePlan, Rendezvous, StageInfo
from scheduler.step_stream import StepStream
from stagemesh.core import kv_ticket, telemetry
from stagemesh.core.deadlines import DEADLINES, Deadlines
from stagemesh.core.errors import StagemeshError
from stagemesh.core.sampling_params import InvalidParameter, SamplingParams, StructuredOutputs
from stagemesh.core.service_options import aio_channel
from stagemesh.core.step import EpochSpec, SampledToken, StepBatch
from stagemesh.core.step_wire import drafts_from_pb, epoch_to_pb, prompt_logprobs_from_pb, sampled_from_pb, step_to_pb
from stagemesh.core.wire import sampling_to_pb
from stagemesh.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc, stage_pb2, stage_pb2_grpc

log = logging.getLogger("stagemesh.scheduler")


class GrpcPipeline:
    overlaps_stages = True

    def __init__(self, rendezvous: Rendezvous, store_host: str, store_port: int, deadlines: Deadlines = DEADLINES):
        self.rendezvous = rendezvous
        self.block_size, self.num_stages = rendezvous.block_size, rendezvous.pp
        self.store_host, self.store_port = store_host, store_port
        self.deadlines = deadlines
        self.plan: PipelinePlan | None = None  # of the epoch joined last
        self.disk_block_hashes: list[int] = []  # the disk tier's blocks every stage held when it joined
        self._channels: dict[str, tuple[grpc.aio.Channel, stage_pb2_grpc.StageStub]] = {}
        self._steps: dict[str, StepStream] = {}  # each stage's step path (scheduler.step_stream)
        self._tasks: set[asyncio.Task] = set()  # channels closing later, referenced until done
        self._answered: set[str] = set()  # addresses of stages that answered a step since the last probe round
        self.kv_read_key = kv_ticket.new_key()  # what the stages ask of a reader of held KV (given at each join)

    # -- membership ----------------------------------------------------------------
    async def register(self, stage: StageInfo) -> tuple[int, bool, str | None]:
        """A stage's registration or heartbeat: (stages still missing, whether this instance is new here, and
        why the pipeline must re-form, or None). A new instance at a known index replaces the old one (a
        restarted stage) unless the old one still answers elsewhere; raises StagemeshError (the reason) when
        the stage does not fit."""
        r = self.rendezvous
        if r.knows(stage):
            return r.missing, False, None
        r.check(stage)
        old = r.stages.get(stage.stage_index)
        if old is not None and old.address != stage.address and await self._probe(old) is None:
            if stage.standby:
                r.add_spare(stage)
                self._drop_channel(stage.address)
                log.info("%s is a spare for %s (--standby)", stage.name, old.name)
                return r.missing, True, None
            raise StagemeshError(f"{old.name} is alive and serves index {stage.stage_index}; stop it first, give "
                                 f"this stage another --stage-index, or start it with --standby to keep it as a "
                                 f"spare")
        missing = r.register(stage)
        self._drop_channel(stage.address)  # whatever answered there before is gone
        if old is not None:
            self._drop_channel(old.address)
        change = f"{stage.name} {'restarted' if old is not None else 'registered'}" if r.complete else None
        return missing, True, change

    def layout(self) -> PipelinePlan | None:
        return self.rendezvous.plan() if self.rendezvous.complete else None

    async def join(self, epoch: int, plan: PipelinePlan, max_model_len: int, max_num_batched_tokens: int) -> None:
        # every stage answers as the instance registered, before any of them waits in the new world
        for failed in await asyncio.gather(*[self._probe(s, wait=True) for s in plan.stages]):
            if failed is not None:
                raise failed
        replies = await asyncio.gather(*[self._join(plan, i, epoch, max_model_len, max_num_batched_tokens)
                                         for i in range(len(plan.stages))])
        # the disk tier's blocks that every stage holds (a restart on the same directories), oldest first
        held = set.intersection(*(set(r.disk_block_hashes) for r in replies)) if replies else set()
        self.disk_block_hashes = [h for h in replies[0].disk_block_hashes if h in held] if replies else []
        self.plan = plan

    async def _join(self, plan: PipelinePlan, index: int, epoch: int, max_model_len: int,
                    max_num_batched_tokens: int) -> stage_pb2.JoinPipelineResponse:
        stage = plan.stages[index]
        spec = EpochSpec(
            epoch, self.store_host, self.store_port, plan.world_size, plan.rank_offsets[index], tuple(plan.tp_sizes),
            plan.num_kv_blocks, max_model_len, max_num_batched_tokens,
            next_stage_address=plan.stages[index + 1].address if index + 1 < len(plan.stages) else "",
            first_stage_address=plan.stages[0].address if 0 < index == len(plan.stages) - 1 else "",
            num_host_kv_blocks=plan.num_host_kv_blocks, kv_read_key=self.kv_read_key)
        return await _answer(stage, self._stub(stage).JoinPipeline(epoch_to_pb(spec), timeout=self.deadlines.join_s))

    # -- steps ---------------------------------------------------------------------------
    def forward(self, epoch: int, batch: StepBatch, span: trace.Span | None, trace_links: list[str]):
        """Send the step to every stage now, on each one's step stream (not when the result is first awaited), so
        that it goes out ahead of the stream writes queued behind it."""
        request = stage_pb2.ForwardRequest(epoch=epoch, trace_links=trace_links)
        step_to_pb(batch, request.step)
        if span is not None:
            context = dict(telemetry.inject(trace.set_span_in_context(span)))
            request.traceparent, request.tracestate = context.get("traceparent", ""), context.get("tracestate", "")
        assert self.plan is not None  # (steps come after the join)
        return self._result([(stage, self._step_stream(stage).send(request)) for stage in self.plan.stages])

    async def _result(self, calls) -> StepResult:
        """The step's replies (each stage's step stream's future gives it, or raises StageFailure naming it)."""
        answers = [answer for _, answer in calls]
        try:
            replies = [await answers[0]] if len(answers) == 1 else await asyncio.gather(*answers)
        except StageFailure as first:
            raise await _culprit(first, answers) from None
        for stage, _ in calls:
            self._answered.add(stage.address)
        msg = replies[-1].sampled
        rows = len(msg.seq_ids)
        # a plain step's reply has its rows' sequence and token ids only (no logprobs, errors, pooled outputs or
        # drafts): the other columns are checked and read only where it has some
        plain = len(msg.ListFields()) == (2 if rows else 0)
        if len(msg.token_ids) != rows or not (plain or _extras_line_up(msg)):
            raise StageFailure(calls[-1][0], "the stage's sampled-token columns do not line up")
        compute_seconds = sum(r.compute_seconds for r in replies)
        if plain:
            return StepResult(list(map(SampledToken, msg.seq_ids, msg.token_ids)), [], compute_seconds, {})
        try:
            sampled = sampled_from_pb(msg)
        except (ValueError, StagemeshError) as err:  # a pooled output whose bytes do not fill its shape
            raise StageFailure(calls[-1][0], f"the stage's pooled outputs are malformed: {err}") from None
        return StepResult(sampled, prompt_logprobs_from_pb(msg), compute_seconds, drafts_from_pb(msg))

    # -- structured outputs --------------------------------------------------------------
    async def compile_grammar(self, structured: StructuredOutputs, timeout_s: float) -> None:
        if self.plan is None:
            raise StagemeshError("no pipeline is formed to compile the constraint on")
        last = self.plan.stages[-1]
        request = stage_pb2.CompileGrammarRequest()
        sampling_to_pb(SamplingParams(structured=structured), request.sampling)
        try:
            await self._stub(last).CompileGrammar(request, timeout=timeout_s)
        except grpc.aio.AioRpcError as err:
            if err.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise InvalidParameter("structured_outputs", err.details() or "it does not compile") from None
            if err.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise TimeoutError from None
            raise StagemeshError(f"{last.name} did not compile the constraint: {err.code().name}") from None

    # -- disaggregated prefill ------------------------------------------------------------
    async def pull_kv(self, epoch: int, pull, timeout_s: float) -> int:
        src = pull.source
        request = stage_pb2.PullKVRequest(
            epoch=epoch, block_ids=pull.block_ids, source_epoch=src.epoch, source_block_ids=src.block_ids,
            source_block_size=src.block_size,
            sources=[stage_pb2.KVSource(address=a, layer_start=s, layer_end=e) for a, s, e in src.stages],
            source_ticket=src.read_ticket)
        # each stage reads within timeout_s (its deadline less kv_write_s); the rest is for its write
        deadline = timeout_s + self.deadlines.kv_write_s
        assert self.plan is not None  # (KV moves after the join, as steps do)
        calls = [(stage, self._stub(stage).PullKV(request, timeout=deadline)) for stage in self.plan.stages]
        # every call ends before the pull does (a failed one does not leave the others writing into its blocks)
        replies = await asyncio.gather(*[_answer(stage, call) for stage, call in calls], return_exceptions=True)
        for reply in replies:
            if isinstance(reply, BaseException):
                raise reply
        return sum(r.bytes for r in replies if not isinstance(r, BaseException))  # (none is, by now)

    async def release_kv(self, source, timeout_s: float | None = None) -> bool | None:
        channel = aio_channel(source.scheduler_address)
        try:
            reply = await scheduler_pb2_grpc.SchedulerStub(channel).ReleaseKV(
                scheduler_pb2.ReleaseKVRequest(request_id=source.request_id),
                timeout=min(timeout_s or self.deadlines.kv_release_s, self.deadlines.kv_release_s))
            return reply.released
        except grpc.aio.AioRpcError as err:  # its hold times out by itself
            log.warning("could not release the KV of request %s at %s: %s", source.request_id,
                        source.scheduler_address, err.details())
            return None
        finally:
            await channel.close()

    # -- KV tiers ------------------------------------------------------------------------------
    async def store_kv(self, epoch: int, block_ids: list[int], host_slots: list[int], hashes: list[int],
                       to_disk: list[bool], disk_evictions: list[int]) -> None:
        """Every stage copies the blocks into its host tier (and queues the disk writes); raises StageFailure."""
        request = stage_pb2.StoreKVRequest(epoch=epoch, block_ids=block_ids, host_slots=host_slots,
                                           block_hashes=hashes, to_disk=to_disk, disk_evictions=disk_evictions)
        assert self.plan is not None
        await asyncio.gather(*[_answer(stage, self._stub(stage).StoreKV(request, timeout=self.deadlines.kv_store_s))
                               for stage in self.plan.stages])

    async def load_kv(self, epoch: int, block_ids: list[int], host_slots: list[int], hashes: list[int]
                      ) -> list[bool]:
        """Every stage fills the blocks from its tiers: per block, whether every stage did; raises StageFailure."""
        request = stage_pb2.LoadKVRequest(epoch=epoch, block_ids=block_ids, host_slots=host_slots,
                                          block_hashes=hashes)
        assert self.plan is not None
        replies = await asyncio.gather(*[_answer(stage, self._stub(stage).LoadKV(request,
                                                                                timeout=self.deadlines.kv_load_s))
                                         for stage in self.plan.stages])
        for stage, reply in zip(self.plan.stages, replies):
            if len(reply.loaded) != len(block_ids):
                raise StageFailure(stage, f"LoadKV answered {len(reply.loaded)} flags for {len(block_ids)} blocks")
        return [all(flags) for flags in zip(*(r.loaded for r in replies))]

    # -- probing -------------------------------------------------------------------------
    async def probe(self) -> StageFailure | None:
        """The first stage that does not answer its health check, or None. A check that only ran out of time
        is forgiven for a stage that answered a step since the last round: it is busy, not gone (a loaded host
        can hold a Describe past its deadline while steps go through); a stage that hangs answers no step."""
        if not self.rendezvous.complete:
            return None
        answered, self._answered = self._answered, set()
        stages = [self.rendezvous.stages[i] for i in range(self.rendezvous.pp)]
        results = await asyncio.gather(*[self._probe(s) for s in stages])
        for i, (stage, failure) in enumerate(zip(stages, results)):
            if failure is not None and failure.timed_out and stage.address in answered:
                log.warning("%s did not answer its health check within %gs, but it answers steps: kept (a busy "
                            "host)", stage.name, self.deadlines.probe_s)
                results[i] = None
        for stage, failure in zip(stages, results):
            if failure is not None:
                await self._promote_spare(stage)  # the next probe finds the pipeline whole again
        return next((r for r in results if r is not None), None)

    async def _promote_spare(self, failed: StageInfo) -> None:
        """A spare that answers takes the place of `failed`; spares that do not answer are forgotten."""
        for spare in self.rendezvous.spares_for(failed.stage_index):
            if await self._probe(spare) is None:
                self.rendezvous.promote(spare)
                self._drop_channel(failed.address)
                log.warning("%s does not answer: the spare %s takes its place", failed.name, spare.name)
                return
            log.warning("forgetting the spare %s: it does not answer", spare.name)
            self.rendezvous.drop_spare(spare)

    async def _probe(self, stage: StageInfo, wait: bool = False) -> StageFailure | None:
        """None when the registered instance of `stage` answers; else what went wrong.
        wait=True gives a (re)starting stage a few seconds to come up."""
        d = self.deadlines
        try:
            desc = await _answer(stage, self._stub(stage).Describe(stage_pb2.DescribeRequest(),
                                                                  timeout=d.probe_starting_s if wait else d.probe_s,
                                                                  wait_for_ready=wait))
        except StageFailure as err:
            return err
        if desc.instance_id != stage.instance_id:
            return StageFailure(stage, "another process answers at its address (the stage restarted and has not "
                                       "registered yet)")
        return None

    # -- LoRA adapters at run time (scheduler.lora_admin) --------------------------------
    def stages_and_spares(self) -> list[StageInfo]:
        r = self.rendezvous
        return [*r.stages.values(), *(s for i in range(r.pp) for s in r.spares_for(i))]

    async def load_lora(self, stage: StageInfo, name: str, path: str) -> None:
        """The stage reads the adapter (StageFailure with its reason when it cannot)."""
        request = common_pb2.LoadLoRAAdapterRequest(adapter=common_pb2.LoRAAdapter(name=name, path=path))
        await _answer(stage, self._stub(stage).LoadLoRAAdapter(request, timeout=self.deadlines.lora_load_s))

    async def unload_lora(self, stage: StageInfo, name: str) -> None:
        request = common_pb2.UnloadLoRAAdapterRequest(name=name)
        try:
            await _answer(stage, self._stub(stage).UnloadLoRAAdapter(request, timeout=self.deadlines.lora_load_s))
        except StageFailure as err:  # a stage that is gone, or never had it: nothing to undo
            log.info("LoRA adapter %r: unloading: %s", name, err)

    # -- channels ------------------------------------------------------------------------
    def _stub(self, stage: StageInfo) -> stage_pb2_grpc.StageStub:
        if stage.address not in self._channels:
            channel = aio_channel(stage.address, options=[("grpc.max_receive_message_length", 1 << 30)])
            self._channels[stage.address] = (channel, stage_pb2_grpc.StageStub(channel))
        return self._channels[stage.address][1]

    def _step_stream(self, stage: StageInfo) -> StepStream:
        stream = self._steps.get(stage.address)
        if stream is None or stream.closed:
            stream = self._steps[stage.address] = StepStream(stage, self._stub(stage), self.deadlines.forward_s)
        return stream

    def _drop_channel(self, address: str) -> None:
        """A new process answers at this address: dial it afresh (the old channel may be backing off).
        The old one closes once every call on it is past its deadline (closing cancels its calls); its step
        stream ends now (its steps fail: the epoch they belong to is over)."""
        stream = self._steps.pop(address, None)
        if stream is not None:
            stream.close()
        entry = self._channels.pop(address, None)
        if entry is not None:
            task = asyncio.create_task(_close_later(entry[0], self.deadlines.channel_linger_s))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)


def _extras_line_up(msg: stage_pb2.SampledTokens) -> bool:
    """Whether a reply's logprob, error, pooled and draft columns line up with its rows."""
    rows = len(msg.seq_ids)
    return (len(msg.logprob_rows) == len(msg.logprobs) and len(msg.error_rows) == len(msg.errors)
            and len(msg.pooled_rows) == len(msg.pooled)
            and all(0 <= r < rows for r in (*msg.logprob_rows, *msg.error_rows, *msg.pooled_rows))
            and len(msg.draft_seq_ids) == len(msg.num_draft_tokens)
            and all(n >= 0 for n in msg.num_draft_tokens) and sum(msg.num_draft_tokens) == len(msg.draft_token_ids))


async def _answer(stage: StageInfo, call):
    """The call's reply, or StageFailure naming the stage."""
    try:
        return await call
    except grpc.aio.AioRpcError as err:
        raise StageFailure(stage, f"{err.code().name}: {err.details()}",
                           unreachable=err.code() == grpc.StatusCode.UNAVAILABLE,
                           timed_out=err.code() == grpc.StatusCode.DEADLINE_EXCEEDED) from None
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is None or task.cancelling() > 0:  # this task is being cancelled
            raise
        raise StageFailure(stage, "the call was cancelled") from None  # the channel closed under the call


# how long a step's failure waits for its other stages' calls to end, to name the stage that died
CULPRIT_WAIT_S = 0.5


async def _culprit(first: StageFailure, answers: Sequence[asyncio.Future]) -> StageFailure:
    """The failure to report for a step: a stage that did not answer at all, before one that answered first that
    its handoff broke (a stage waiting on a killed peer's activations or tokens often fails before the peer's own
    call does)."""
    if first.unreachable:
        return first
    pending = [a for a in answers if not a.done()]
    if pending:
        await asyncio.wait(pending, timeout=CULPRIT_WAIT_S)
    failures = [a.exception() for a in answers if a.done() and not a.cancelled()]
    return next((f for f in failures if isinstance(f, StageFailure) and f.unreachable), first)


async def _close_later(channel: grpc.aio.Channel, delay_s: float) -> None:
    await asyncio.sleep(delay_s)
    await channel.close()
