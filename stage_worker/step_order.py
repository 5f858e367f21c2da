"""The order in which a stage takes steps: its epoch's step ids, one after the other.

Forward calls may arrive out of order (replies and requests overtake each other on the
wire). A step that comes early waits for its turn here, as an awaiting coroutine of the
stage's asyncio server, never a thread: at most `window` steps ahead of the next one, each
for at most `timeout_s`; anything else (another epoch, a step already taken or far ahead,
a second call for the same step) is refused at once.
"""
from __future__ import annotations

import asyncio

from stagemesh.core.deadlines import DEADLINES
from stagemesh.core.errors import StagemeshError


class OutOfOrder(StagemeshError):
    """A step that is not this stage's to take (FAILED_PRECONDITION)."""


def window_for(num_stages: int) -> int:
    """Steps a stage accepts ahead of the next: a pipeline keeps one in flight per stage, plus one run ahead."""
    return 16 + 2 * num_stages


class StepOrder:
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
