"""A stage takes its epoch's steps in order; early steps wait (bounded, with a deadline), the rest are refused."""
from __future__ import annotations

import asyncio

import pytest

from stage_worker.step_executor import OutOfOrder, StepOrder


def run(coro):
    return asyncio.run(coro)


def test_steps_that_arrive_out_of_order_are_taken_in_order():
    async def main():
        order, taken = StepOrder(window=4), []
        order.open(epoch=3)

        async def step(i):
            await order.turn(3, i)
            taken.append(i)
            order.advance(i)

        await asyncio.gather(step(2), step(1), step(0), step(3))
        return taken

    assert run(main()) == [0, 1, 2, 3]


@pytest.mark.parametrize("epoch,step,words", [
    (2, 0, "belongs to epoch 2, which is not the stage.s$"),  # (the stage's own epoch is not told)
    (3, 8, "more than 4 steps ahead"),
])
def test_steps_of_another_epoch_or_far_ahead_are_refused_at_once(epoch, step, words):
    async def main():
        order = StepOrder(window=4)
        order.open(epoch=3)
        with pytest.raises(OutOfOrder, match=words):
            await order.turn(epoch, step)
        assert not order._waiting

    run(main())


def test_a_step_taken_already_or_waiting_twice_is_refused():
    async def main():
        order = StepOrder(window=4)
        order.open(3, 0)
        await order.turn(3, 0)
        order.advance(0)
        with pytest.raises(OutOfOrder, match="was taken already"):
            await order.turn(3, 0)
        waiter = asyncio.create_task(order.turn(3, 2))
        await asyncio.sleep(0)
        with pytest.raises(OutOfOrder, match="already waiting"):
            await order.turn(3, 2)
        order.close()
        with pytest.raises(OutOfOrder, match="ended while it waited"):
            await waiter

    run(main())


def test_an_early_step_whose_predecessor_never_comes_gives_up_after_the_deadline():
    async def main():
        order = StepOrder(window=4, timeout_s=0.1)
        order.open(3, 0)
        with pytest.raises(OutOfOrder, match="waited 0s for step 0, which never came"):
            await order.turn(3, 1)
        assert not order._waiting  # nothing left behind
        await order.turn(3, 0)  # the order itself is unharmed

    run(main())


def test_between_epochs_every_step_is_refused():
    async def main():
        order = StepOrder()
        with pytest.raises(OutOfOrder, match="between epochs"):
            await order.turn(0, 0)

    run(main())
