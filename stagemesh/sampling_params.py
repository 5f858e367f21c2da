"""Sampling parameters: the domain type every service passes around, and the one set of rules
every entry point checks them by (the router, the gRPC frontend, the scheduler's Submit and a
stage's Forward), so that a value that passes one passes all and none can fail a step.

The rules: every number finite and in range, every value representable in the wire type
(floats travel as float32, ids and counts as int32), token ids inside the vocabulary where the
vocabulary is known. Wire conversion is in stagemesh.wire.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from stagemesh.errors import StagemeshError

INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_LOGPROBS = 20
# A temperature below this samples greedily, as vLLM treats it: dividing logits by a
# denormal (1e-45) overflows them to inf, and inf - inf is NaN in the softmax.
SAMPLING_EPS = 1e-5

# name -> (test, what the value must be); floats are tested after rounding to float32
FLOAT_RULES: dict[str, tuple[Callable[[float], bool], str]] = {
    "temperature": (lambda v: 0 <= v <= 2, "a number in [0, 2]"),
    "top_p": (lambda v: 0 < v <= 1, "a number in (0, 1]"),
    "min_p": (lambda v: 0 <= v <= 1, "a number in [0, 1]"),
    "repetition_penalty": (lambda v: 0 < v <= 2, "a number in (0, 2]"),
    "presence_penalty": (lambda v: -2 <= v <= 2, "a number in [-2, 2]"),
    "frequency_penalty": (lambda v: -2 <= v <= 2, "a number in [-2, 2]"),
}
INT_RULES: dict[str, tuple[Callable[[int], bool], str]] = {
    "top_k": (lambda v: v == -1 or 0 <= v <= INT32_MAX, f"-1 or an integer in [0, {INT32_MAX}]"),
    "seed": (lambda v: INT64_MIN <= v <= INT64_MAX, "a 64-bit integer"),
    "max_tokens": (lambda v: 1 <= v <= INT32_MAX, f"an integer in [1, {INT32_MAX}]"),
    "min_tokens": (lambda v: 0 <= v <= INT32_MAX, f"an integer in [0, {INT32_MAX}]"),
    "logprobs": (lambda v: 0 <= v <= MAX_LOGPROBS, f"an integer in [0, {MAX_LOGPROBS}]"),
}


class InvalidParameter(StagemeshError):
    """A request parameter breaks a rule; `param` names it (the OpenAI error's `param`)."""

    def __init__(self, param: str | None, message: str):
        super().__init__(message)
        self.param = param


def as_float32(value: float) -> float:
    """The value the wire carries for a float field."""
    return float(np.float32(value)) if abs(value) < 3.4e38 else float("inf") if value > 0 else float("-inf")


def check_float(name: str, value) -> float:
    test, what = FLOAT_RULES[name]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidParameter(name, f"'{name}' must be {what}, got {type(value).__name__}")
    try:
        rounded = as_float32(float(value))
    except OverflowError:  # an integer past the largest double
        rounded = float("inf")
    if not test(rounded):  # NaN fails every test, inf every bounded range
        raise InvalidParameter(name, f"'{name}' must be {what}, got {value!r}")
    return rounded


def check_int(name: str, value) -> int:
    test, what = INT_RULES[name]
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise InvalidParameter(name, f"'{name}' must be {what}, got {type(value).__name__}")
    if not test(int(value)):
        raise InvalidParameter(name, f"'{name}' must be {what}, got {value!r}")
    return int(value)


def check_token_ids(name: str, ids: Sequence[int], vocab_size: int | None) -> None:
    """Integer token ids are int32 and, where the vocabulary is known, inside it (C-speed min/max:
    prompts are long)."""
    if not ids:
        return
    limit = INT32_MAX + 1 if vocab_size is None else vocab_size
    low, high = min(ids), max(ids)
    if low < 0 or high >= limit:
        bad = low if low < 0 else high
        where = f"the vocabulary of {vocab_size}" if vocab_size is not None else "int32"
        raise InvalidParameter(name, f"token id {bad} in '{name}' is outside {where}")


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # below SAMPLING_EPS: greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; 0: sampled token only; N: top N too

    def __post_init__(self) -> None:
        for name in FLOAT_RULES:  # stored as the wire carries them, so every service sees one value
            object.__setattr__(self, name, check_float(name, getattr(self, name)))
        for name in INT_RULES:
            value = getattr(self, name)
            if value is not None or name not in ("seed", "logprobs"):
                check_int(name, value)
        if self.min_tokens > self.max_tokens:
            raise InvalidParameter("min_tokens", "min_tokens must be in [0, max_tokens]")
        if not all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in self.stop_token_ids):
            raise InvalidParameter("stop_token_ids", "'stop_token_ids' must be an array of integers")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        check_token_ids("stop_token_ids", self.stop_token_ids, None)

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    def check_vocab(self, vocab_size: int) -> None:
        """The token ids these parameters name exist in a vocabulary of `vocab_size`."""
        check_token_ids("stop_token_ids", self.stop_token_ids, vocab_size)
