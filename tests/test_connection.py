"""A multiplexed connection gathers what a step produced for all its requests into one take."""
from __future__ import annotations

import asyncio

from scheduler.connection import Connection, Rejected
from scheduler.request import RequestOutput
from scheduler.scheduler import QueueFull


def take(connection: Connection):
    return asyncio.run(connection.take())


def test_one_take_holds_every_request_merged_and_marks_first_updates():
    c = Connection()
    for request_id in ("a", "b"):
        c.added(request_id)
    c.put(RequestOutput("a", [5], num_prompt_tokens=3))
    c.put(RequestOutput("b", [9], num_prompt_tokens=4))
    c.put(RequestOutput("a", [6], num_prompt_tokens=3))
    updates = take(c)
    assert [(u.item.request_id, u.item.new_token_ids, u.first) for u in updates] == [("a", [5, 6], True),
                                                                                     ("b", [9], True)]
    c.put(RequestOutput("a", [7], finish_reason="length"))
    (update,) = take(c)
    assert update.item.new_token_ids == [7] and update.item.finish_reason == "length" and not update.first
    assert c.running == {"b"}  # a finished


def test_an_error_follows_the_tokens_before_it_and_ends_the_request():
    c = Connection()
    c.added("a")
    c.put(RequestOutput("a", [5]))
    c.put(RequestOutput("a", finish_reason="error", error="stage 1 failed"))
    tokens, error = take(c)
    assert tokens.item.new_token_ids == [5] and tokens.first
    assert error.item.error == "stage 1 failed" and not error.first
    assert not c.running


def test_rejections_and_forgotten_requests():
    c = Connection()
    c.added("a")
    c.put(RequestOutput("a", [5]))
    c.forget("a")  # aborted by the client: its pending output is dropped too
    c.reject("b", QueueFull("the waiting queue is full (1 requests)"))
    (update,) = take(c)
    assert isinstance(update.item, Rejected) and update.item.request_id == "b"
    assert isinstance(update.item.error, QueueFull) and not c.running


def test_close_wakes_the_writer_with_nothing_pending():
    c = Connection()
    c.close()
    assert take(c) == [] and c.closed
