"""Router pieces without processes: incremental detokenization, stop strings, balancing."""
from __future__ import annotations

from dataclasses import dataclass

import pytest

from router.balancing import CacheAware, LeastLoad, RoundRobin
from router.tokenization import IncrementalDetokenizer, StopStrings, Tokenizer


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    return Tokenizer(default_model_dir)


@pytest.mark.parametrize("text", ["Paris is the capital of France.", "naïve café — 東京 🚀 done",
                                  "  spaces\n\nand\ttabs  ", "def f(x):\n    return x ** 2"])
def test_incremental_detokenization_equals_decoding_all_at_once(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.add([i]) for i in ids]
    assert "".join(pieces) == tokenizer.decode(ids)
    assert all("\ufffd" not in p for p in pieces)  # half a character is never sent


def test_stop_strings_never_leak_across_deltas():
    stops = StopStrings(["STOP", "\n\n"])
    sent = "".join(stops.feed(d) for d in ["Hello wo", "rld S", "TO", "P and more"])
    assert sent == "Hello world " and stops.stopped == "STOP"
    assert stops.feed("later") == ""


def test_stop_strings_release_held_text_at_the_end():
    stops = StopStrings(["STOP"])
    assert stops.feed("abcST") == "ab"  # "ST" could start STOP: held back
    assert stops.flush() == "cST"


@dataclass
class FakeLoad:
    """A replica as the policies see it: an address and a load figure."""

    address: str
    load: int = 0


def test_least_load_and_round_robin():
    a, b = FakeLoad("a", 5), FakeLoad("b", 2)
    assert LeastLoad().pick([a, b], [1]) is b
    rr = RoundRobin()
    assert [rr.pick([a, b], [1]).address for _ in range(4)] == ["a", "b", "a", "b"]


def test_cache_aware_follows_the_prefix_until_load_is_unbalanced():
    policy = CacheAware(block=4, balance_abs=8, balance_rel=1.5)
    a, b = FakeLoad("a", 0), FakeLoad("b", 0)
    prompt = list(range(40))
    first = policy.pick([a, b], prompt)
    other = b if first is a else a
    first.load = 3  # a little busier: the cached prefix still wins
    assert policy.pick([a, b], prompt + [99]) is first
    first.load, other.load = 50, 1  # now unbalanced: least-load takes over
    assert policy.pick([a, b], prompt) is other
    assert policy.pick([a, b], [7, 7, 7, 7, 7]) is other  # no match: least loaded
