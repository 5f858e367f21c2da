"""A stage's steps, one at a time in step order, on the process's main thread (TP rank 0).

The one owner of what a decoded step goes through: its turn in the epoch's step order (StepOrder: a
step that comes early waits as a coroutine of the gRPC server's event loop, never holding a thread),
the run on the thread that loaded the model (stage_worker.main_loop), the tokens of a step run ahead
(RunAhead), the message to the TP followers (stage_worker.control) and the handoff between stages
(stage_worker.handoff). The servicer decodes, submits here and encodes the reply.

Steps run ahead (async scheduling): the scheduler may send a sequence's next step before the step in
flight has sampled its token (scheduler.request.Request.num_output_placeholders counts them); that
chunk ends in PLACEHOLDER, which the first stage replaces with the sampled token before it embeds the
chunk. The last stage knows the token once it has run the step before. With one stage, it fills the
step itself. With several, the last stage sends the tokens back to the first over the handoff the
stages share (a send on the epoch's world with the nccl handoff, a PushActivations call carrying
sampled_tokens with the grpc one) as soon as it has run the step before, ahead of waiting for the
step's activations, which the first stage computes only once it has the tokens.
"""
from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import Future
from contextlib import nullcontext
from dataclasses import replace
from typing import Callable

from stagemesh.core.deadlines import DEADLINES
from stagemesh.core.errors import StagemeshError
from stagemesh.core.step import EpochSpec, StepBatch, StepStats
from stage_worker import control, eplb
from stage_worker import dist as sdist
from stage_worker.handoff import DistHandoff, GrpcHandoff, Handoff
from stage_worker.main_loop import MainLoop
from stage_worker.moe import uncounted
from stage_worker.runner import StageOutput
from stage_worker.sampler import Sampler
from stage_worker.validate import StepLimits, check_state, check_step

log = logging.getLogger("stagemesh.stage")


class OutOfOrder(StagemeshError):
    """A step that is not this stage's to take (FAILED_PRECONDITION)."""


def window_for(num_stages: int) -> int:
    """Steps a stage accepts ahead of the next: a pipeline keeps one in flight per stage, plus one run ahead."""
    return 16 + 2 * num_stages


class StepOrder:
    """The order in which a stage takes steps: its epoch's step ids, one after the other. Forward calls may
    arrive out of order (replies and requests overtake each other on the wire). A step that comes early waits
    for its turn here, as an awaiting coroutine of the stage's asyncio server, never a thread: at most `window`
    steps ahead of the next one, each for at most `timeout_s`; anything else (another epoch, a step already
    taken or far ahead, a second call for the same step) is refused at once."""

    def __init__(self, window: int = 16, timeout_s: float = DEADLINES.step_turn_s):
        self.window, self.timeout_s = window, timeout_s
        self.epoch = -1  # -1: between epochs, every step is refused
        self.next_step = 0
        self._waiting: dict[int, asyncio.Future] = {}

    def open(self, epoch: int, window: int | None = None) -> None:
        """A new epoch: its steps start at 0."""
        self.close()
        self.epoch, self.next_step = epoch, 0
        self.window = window or self.window

    def close(self) -> None:
        """The epoch ends: steps waiting in it are refused."""
        self.epoch = -1
        for future in self._waiting.values():
            if not future.done():
                future.set_result(None)
        self._waiting.clear()

    async def turn(self, epoch: int, step_id: int) -> None:
        """Returns when `step_id` is the next step of `epoch`; the caller then queues it and calls advance()."""
        self._check(epoch, step_id)
        if step_id == self.next_step:
            return
        future = asyncio.get_running_loop().create_future()
        self._waiting[step_id] = future
        try:
            await asyncio.wait_for(future, self.timeout_s)
        except asyncio.TimeoutError:
            raise OutOfOrder(f"step {step_id} waited {self.timeout_s:.0f}s for step {self.next_step}, which never "
                             "came") from None
        finally:
            if self._waiting.get(step_id) is future:
                del self._waiting[step_id]
        if self.epoch != epoch or self.next_step != step_id:
            raise OutOfOrder(f"the epoch of step {step_id} ended while it waited")

    def advance(self, step_id: int) -> None:
        """`step_id` is queued: the next one may go."""
        if step_id == self.next_step:
            self.next_step += 1
            future = self._waiting.get(self.next_step)
            if future is not None and not future.done():
                future.set_result(None)

    def _check(self, epoch: int, step_id: int) -> None:
        if epoch != self.epoch:
            where = "; the stage is between epochs" if self.epoch < 0 else ", which is not the stage's"
            raise OutOfOrder(f"step {step_id} belongs to epoch {epoch}{where}")
        if step_id < self.next_step:
            raise OutOfOrder(f"step {step_id} was taken already (the next is {self.next_step})")
        if step_id >= self.next_step + self.window:
            raise OutOfOrder(f"step {step_id} is more than {self.window} steps ahead of step {self.next_step}")
        if step_id in self._waiting:
            raise OutOfOrder(f"step {step_id} is already waiting for its turn")


class RunAhead:
    """A stage's part in the steps run ahead (the module's docstring) of one epoch: the last stage of several
    publishes the tokens, the first fills them in."""

    def __init__(self, runner, handoff, epoch: int):
        self.runner, self.handoff, self.epoch = runner, handoff, epoch
        self._told = False

    def publish(self, batch: StepBatch) -> None:
        """Last stage of several: send the first stage the tokens `batch` needs (the step before has run)."""
        self.handoff.send_tokens(batch.step_id, self._sampler().last_tokens(batch))

    def fill(self, batch: StepBatch) -> list[int]:
        """First stage: the tokens from this stage's own samples (one stage) or from the last stage's; returns
        them (the TP followers fill theirs with the same)."""
        if self.runner.is_last_stage:
            tokens = self._sampler().last_tokens(batch)
        else:
            if not self._told:
                self._told = True
                log.info("steps scheduled ahead take their sampled tokens from the last stage (epoch %d)",
                         self.epoch)
            tokens = self.handoff.recv_tokens(batch.step_id, len(batch.chunks.placeholders()))
        batch.chunks.fill_placeholders(tokens)
        return tokens

    def _sampler(self) -> Sampler:
        if self.runner.sampler is None:
            raise StagemeshError("only the last stage's TP rank 0 knows the sampled tokens a step ahead needs")
        return self.runner.sampler


class StepExecutor:
    """Steps of the stage's epoch in order. `followers`: the channel to TP ranks > 0, which run every step
    beside rank 0 (each step reaches them as the bytes the scheduler sent, see stage_worker.control.step_message);
    None without followers; `ep`: the MoE layers' expert-parallel group across replicas; `balancer`: EPLB over
    the TP ranks."""

    def __init__(self, runner, stage_index: int, handoff_kind: str, limits: StepLimits,
                 followers: control.FollowerChannel | None, ep=None, balancer: eplb.Balancer | None = None):
        self.runner, self.stage_index, self.handoff_kind = runner, stage_index, handoff_kind
        self.limits, self.followers, self.ep, self.balancer = limits, followers, ep, balancer
        self.loop = MainLoop()  # steps and KV allocation run on the main thread once it serves the loop
        self.order = StepOrder()
        self.epoch = -1  # nothing is allowed before a join
        self.handoff: Handoff | None = None
        self.run_ahead: RunAhead | None = None

    # -- the main thread ------------------------------------------------------------
    def start(self) -> None:
        """From here on the model's work waits for run_until."""
        self.loop.start()

    def run_until(self, stop, idle=None) -> None:
        """Run steps (and KV work) on the calling thread, the one that loaded the model, until `stop`."""
        self.loop.run_until(stop, idle=idle)

    # -- epochs -----------------------------------------------------------------------
    async def join(self, spec: EpochSpec, join: Callable[[EpochSpec], None]) -> None:
        """Steps of the old epoch stop waiting; `join` (the worker's: it blocks in torch.distributed, so it runs
        on a worker thread) moves the stage into `spec`'s epoch, whose steps may then come."""
        self.order.close()
        await asyncio.to_thread(join, spec)
        self.order.open(spec.epoch, window_for(len(spec.tp_sizes)))

    def begin_epoch(self, spec: EpochSpec, rank: int) -> None:
        """The handoff and the limits of `spec`'s epoch, which this stage joined as global `rank`."""
        index, sizes = self.stage_index, list(spec.tp_sizes)
        first, last = index == 0, index == len(sizes) - 1
        if self.handoff_kind == "nccl":
            prev_rank = sum(sizes[:index - 1]) if index > 0 else None
            next_rank = rank + sizes[index] if not last else None
            # steps run ahead: the tokens go from the last stage's rank 0 to the first's
            tokens_rank = None if first and last else 0 if last else sum(sizes[:-1]) if first else None
            self.handoff = DistHandoff(prev_rank, next_rank, self.runner.device, tokens_rank)
        else:
            self.handoff = GrpcHandoff(spec.next_stage_address or None, self.runner.device, spec.epoch,
                                       window_for(len(sizes)), spec.first_stage_address if last else None)
        self.run_ahead = RunAhead(self.runner, self.handoff, spec.epoch)
        self.limits = replace(self.limits, num_kv_blocks=spec.num_kv_blocks, max_model_len=spec.max_model_len,
                              max_num_batched_tokens=spec.max_num_batched_tokens)
        self.epoch = spec.epoch

    def end_epoch(self) -> None:
        """Leave the epoch: whatever waits in the handoff wakes with an error."""
        self.epoch = -1
        if self.handoff is not None:
            self.handoff.abort()
            self.handoff.close()

    def abort(self) -> None:
        if self.handoff is not None:
            self.handoff.abort()

    # -- steps --------------------------------------------------------------------------
    async def forward(self, epoch: int, batch: StepBatch, step_bytes: bytes | None
                      ) -> tuple[StepStats, StageOutput]:
        """Run `batch` when its turn comes. `step_bytes`: the step as the scheduler encoded it (StepBatch), what
        the TP followers get; needed only with followers."""
        check_step(batch, self.limits)  # before the step takes a place in the order
        await self.order.turn(epoch, batch.step_id)
        try:
            done = self._queue(epoch, batch, step_bytes)
        finally:
            self.order.advance(batch.step_id)
        # shielded: a cancelled RPC (the scheduler went away) must not cancel a step already queued
        return await asyncio.shield(asyncio.wrap_future(done))

    def _queue(self, epoch: int, batch: StepBatch, step_bytes: bytes | None) -> Future:
        """Queue a step on the main loop (in step order). The future's result is (StepStats, StageOutput)."""
        if epoch != self.epoch:
            raise StagemeshError(f"step {batch.step_id} belongs to epoch {epoch}, which is not the stage's")
        runner, published = self.runner, None
        ahead = batch.chunks.has_placeholders()  # scheduled before the step before had sampled
        if ahead and runner.is_last_stage and not runner.is_first_stage:
            # once the step before has sampled, the first stage gets the tokens this one needs
            assert self.run_ahead is not None  # (the stage joined the epoch)
            published = self.loop.submit(self.run_ahead.publish, batch)
        return self.loop.submit(self._run, batch, step_bytes, ahead, published)

    def _run(self, batch: StepBatch, step_bytes: bytes | None, ahead: bool, published: Future | None
             ) -> tuple[StepStats, StageOutput]:
        filled: list[int]
        runner, sent, filled = self.runner, 0, []
        assert self.handoff is not None and self.run_ahead is not None  # (the stage joined the step's epoch)
        if published is not None:
            published.result()  # done (it ran just before): raises if the tokens could not be handed over
        check_state(runner, batch, self.limits.max_model_len)  # before the handoff: a refused step leaves every
        # stage as it was
        hidden = None
        start = time.perf_counter()
        if not runner.is_first_stage and batch.chunks:
            hidden = self.handoff.recv(batch.step_id, (batch.num_tokens, runner.config.hidden_size), runner.dtype)
        if runner.is_first_stage:
            self.handoff.advance(batch.step_id - 1)  # tokens arrive for this step and later ones only
        if ahead and runner.is_first_stage:
            filled = self.run_ahead.fill(batch)
        wait = time.perf_counter() - start
        start = time.perf_counter()
        if self.followers is not None:  # the step as the scheduler sent it, with the tokens filled in ahead
            assert step_bytes is not None  # (the service encodes it whenever there are followers)
            self.followers.send(control.FORWARD, self.epoch, control.step_message(step_bytes, filled))
            if hidden is not None:
                sdist.broadcast_hidden(hidden, runner.tp)
        with uncounted(runner.model) if batch.warmup else nullcontext():
            if self.ep is None:
                out = runner.execute(batch, hidden)
            else:  # the MoE layers meet the other replicas' stages in this tick
                self.ep.begin(batch.num_tokens)
                try:
                    out = runner.execute(batch, hidden)
                finally:
                    self.ep.end()
        compute = time.perf_counter() - start
        if out.hidden_states is not None:
            sent = self.handoff.send(batch.step_id, out.hidden_states)
        if self.balancer is not None and not batch.warmup:
            self._balance()
        return StepStats(compute, wait, sent), out

    def _balance(self) -> None:
        """EPLB: when it is time, every rank moves experts to their new slots (before the next step)."""
        assert self.balancer is not None
        plans = self.balancer.after_step()
        if plans is None:
            return
        start = time.perf_counter()
        if self.followers is not None:
            self.followers.send(control.EPLB_REBALANCE, self.epoch, eplb.encode(plans))
        moved = eplb.apply(self.runner, plans)
        log.info("stage %d: EPLB moved experts into %d slot(s) of rank 0 in %.3fs", self.stage_index, moved,
                 time.perf_counter() - start)
