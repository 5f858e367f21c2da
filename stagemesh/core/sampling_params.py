"""Sampling parameters: the domain type every service passes around, and the one set of rules
every entry point checks them by (the router, the gRPC frontend, the scheduler's SubmitStream and a
stage's Forward), so that a value that passes one passes all and none can fail a step.

The rules: every number finite and in range, every value representable in the wire type
(floats travel as float32, ids and counts as int32), token ids inside the vocabulary where the
vocabulary is known. Wire conversion is in stagemesh.core.wire.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Callable, Sequence

import numpy as np

from stagemesh.core.errors import StagemeshError
from stagemesh.core.pooling import PoolingParams

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
    "prompt_logprobs": (lambda v: 0 <= v <= MAX_LOGPROBS, f"an integer in [0, {MAX_LOGPROBS}]"),
}
OPTIONAL = ("seed", "logprobs", "prompt_logprobs")
MAX_BIAS = 100.0  # OpenAI's logit_bias range
MAX_BAD_WORD_TOKENS = 1 << 14  # over all bad words of a request
MAX_NUM_BAD_WORDS = 128  # token sequences after tokenization (vLLM's VLLM_MAX_NUM_BAD_WORDS default)


class InvalidParameter(StagemeshError):
    """A request parameter breaks a rule; `param` names it (the OpenAI error's `param`)."""

    def __init__(self, param: str | None, message: str):
        super().__init__(message)
        self.param = param


def too_many_bad_words(count: int) -> str:
    return f"Too many bad words after tokenization: {count}. The max number is {MAX_NUM_BAD_WORDS}."


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


STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
MAX_STRUCTURED_CHARS = 1 << 20  # a schema, regex or grammar (or the choices, together)
MAX_CHOICES = 4096


@dataclass(frozen=True)
class StructuredOutputs:
    """A constraint on the output (vLLM's structured_outputs): `kind` is json (a JSON schema's text),
    json_object, regex, choice (`choices`), grammar (EBNF text, root rule `root`) or structural_tag (its JSON).
    Compiled and enforced where tokens are sampled (stagemesh.core.grammar). `any_whitespace` (json and
    json_object): True lets the output put whitespace between tokens (a bounded run per gap), False makes it
    compact (vLLM's disable_any_whitespace); None is the server's default, which the router fills in."""
    kind: str
    text: str = ""
    choices: tuple[str, ...] = ()
    any_whitespace: bool | None = None

    def __post_init__(self) -> None:
        param = "structured_outputs"
        if self.kind not in STRUCTURED_KINDS:
            raise InvalidParameter(param, f"structured output kind {self.kind!r} is not one of "
                                          f"{', '.join(STRUCTURED_KINDS)}")
        if not isinstance(self.text, str) or not all(isinstance(c, str) for c in self.choices):
            raise InvalidParameter(param, "a structured output's schema, regex, grammar or choices must be text")
        object.__setattr__(self, "choices", tuple(self.choices))
        if len(self.text) + sum(map(len, self.choices)) > MAX_STRUCTURED_CHARS:
            raise InvalidParameter(param, f"a structured output constraint is limited to {MAX_STRUCTURED_CHARS} "
                                          "characters")
        if self.kind == "choice":
            if not self.choices or len(self.choices) > MAX_CHOICES or self.text:
                raise InvalidParameter(param, f"a choice constraint needs 1 to {MAX_CHOICES} strings to choose from")
        elif self.choices or (self.kind == "json_object") != (not self.text):
            raise InvalidParameter(param, f"a {self.kind} constraint takes "
                                          f"{'no text' if self.kind == 'json_object' else 'its text'} only")

    @property
    def key(self) -> tuple:
        """What a compiled grammar is cached by."""
        return self.kind, self.text, self.choices, bool(self.any_whitespace)


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
    prompt_logprobs: int | None = None  # the prompt's tokens' logprobs: None, 0 (own) or N (top N too)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    allowed_token_ids: tuple[int, ...] = ()  # not empty: only these can be sampled
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()  # token sequences never generated
    structured: StructuredOutputs | None = None  # constrained decoding
    # a pooling request (--runner pooling, stagemesh.core.pooling): the last stage pools its prompt instead of
    # sampling; it ends there, its one output carrying the pooled values
    pooling: PoolingParams | None = None

    def __post_init__(self) -> None:
        for name in FLOAT_RULES:  # stored as the wire carries them, so every service sees one value
            object.__setattr__(self, name, check_float(name, getattr(self, name)))
        for name in INT_RULES:
            value = getattr(self, name)
            if value is not None or name not in OPTIONAL:
                check_int(name, value)
        if self.min_tokens > self.max_tokens:
            raise InvalidParameter("min_tokens", "min_tokens must be in [0, max_tokens]")
        if not all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in self.stop_token_ids):
            raise InvalidParameter("stop_token_ids", "'stop_token_ids' must be an array of integers")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        check_token_ids("stop_token_ids", self.stop_token_ids, None)
        self._check_token_controls()

    def _check_token_controls(self) -> None:
        bias = []
        for token_id, value in self.logit_bias:
            if not isinstance(token_id, (int, np.integer)) or isinstance(token_id, bool):
                raise InvalidParameter("logit_bias", "'logit_bias' keys must be token ids")
            rounded = as_float32(float(value)) if isinstance(value, (int, float)) and not isinstance(value, bool) \
                else float("nan")
            if not -MAX_BIAS <= rounded <= MAX_BIAS:
                raise InvalidParameter("logit_bias", f"'logit_bias' values must be numbers in [-100, 100], got "
                                                     f"{value!r} for token {token_id}")
            bias.append((int(token_id), rounded))
        object.__setattr__(self, "logit_bias", tuple(bias))
        check_token_ids("logit_bias", [t for t, _ in bias], None)
        for name in ("allowed_token_ids", "stop_token_ids"):
            if not all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in getattr(self, name)):
                raise InvalidParameter(name, f"'{name}' must be an array of integers")
        object.__setattr__(self, "allowed_token_ids", tuple(int(t) for t in self.allowed_token_ids))
        check_token_ids("allowed_token_ids", self.allowed_token_ids, None)
        words = tuple(tuple(int(t) for t in w) for w in self.bad_words_token_ids)
        if len(words) > MAX_NUM_BAD_WORDS:
            raise InvalidParameter("bad_words", too_many_bad_words(len(words)))
        if any(not w for w in words) or sum(map(len, words)) > MAX_BAD_WORD_TOKENS:
            raise InvalidParameter("bad_words", f"'bad_words' must be non-empty words of {MAX_BAD_WORD_TOKENS} "
                                                "tokens in all at most")
        object.__setattr__(self, "bad_words_token_ids", words)
        check_token_ids("bad_words", [t for w in words for t in w], None)
        if self.structured is not None and not isinstance(self.structured, StructuredOutputs):
            raise InvalidParameter("structured_outputs", "'structured_outputs' must be a StructuredOutputs")
        if self.structured is not None and self.ignore_eos:
            raise InvalidParameter("ignore_eos", "'ignore_eos' cannot go with a structured output constraint: the "
                                                 "output ends where the constraint's language does, with EOS")

    @property
    def computes_whole_prompt(self) -> bool:
        """Whether every prompt position must be computed here: no prefix-cache or KV-tier hit (prompt logprobs,
        as vLLM; pooling, whose MEAN, CLS and token-wise pools read every position's hidden state)."""
        return self.prompt_logprobs is not None or self.pooling is not None

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    def check_vocab(self, vocab_size: int) -> None:
        """The token ids these parameters name exist in a vocabulary of `vocab_size`."""
        check_token_ids("stop_token_ids", self.stop_token_ids, vocab_size)
        check_token_ids("logit_bias", [t for t, _ in self.logit_bias], vocab_size)
        check_token_ids("allowed_token_ids", self.allowed_token_ids, vocab_size)
        check_token_ids("bad_words", [t for w in self.bad_words_token_ids for t in w], vocab_size)

    @property
    def controls_tokens(self) -> bool:
        """Whether sampling must change logits beyond temperature and top-k/p (bias, masks, bans)."""
        return bool(self.logit_bias or self.allowed_token_ids or self.bad_words_token_ids or self.min_tokens
                    or self.structured)


# The fields of one number or switch each (the others are token-id lists, logit_bias and the constraint): they
# cross the wire by name (stagemesh.core.wire) and the HTTP bodies' fields of the same name pass straight in
# (router.openai_request), so a new one is declared here, in the proto and in the HTTP schema, and used.
SCALAR_FIELDS = tuple(f.name for f in fields(SamplingParams) if f.type in ("float", "int", "bool", "int | None"))
