"""Sampled tokens from the last stage to the first, for steps scheduled ahead: through a real TCPStore."""
from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch.distributed as dist

from stage_worker.dist import put_tokens, take_tokens
from stagemesh.errors import StagemeshError


@pytest.fixture
def stores():
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", master.port, is_master=False, timeout=timedelta(seconds=10))
    yield dist.PrefixStore("epoch-3/", master), dist.PrefixStore("epoch-3/", client)


def test_tokens_cross_once_and_the_key_is_gone(stores):
    last, first = stores
    put_tokens(last, 7, [5, 49151, 0, 2**31 - 1])
    assert take_tokens(first, 7, timeout_s=5, alive=lambda: True) == [5, 49151, 0, 2**31 - 1]
    assert not last.check(["tokens/7"])  # taken: the store does not grow with the steps


def test_the_first_stage_waits_for_tokens_put_later(stores):
    last, first = stores
    timer = threading.Timer(0.7, put_tokens, (last, 8, [11]))
    timer.start()
    try:
        assert take_tokens(first, 8, timeout_s=5, alive=lambda: True) == [11]
    finally:
        timer.cancel()


def test_a_wait_ends_with_the_epoch_or_its_deadline(stores):
    _, first = stores
    with pytest.raises(StagemeshError, match="epoch ended while step 9"):
        take_tokens(first, 9, timeout_s=30, alive=lambda: False)
    with pytest.raises(StagemeshError, match="no sampled tokens from the last stage for step 9 in 1s"):
        take_tokens(first, 9, timeout_s=1, alive=lambda: True)
