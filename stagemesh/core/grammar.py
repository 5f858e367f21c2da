"""Constrained decoding: structured-output constraints compiled into token-level grammars, and the matcher
that follows one sequence's output.

The library is xgrammar, vLLM's default backend: a grammar is compiled once against the tokenizer's
vocabulary (JSON schema, regex, choice and EBNF all become one grammar form), and a matcher fills a packed
bitmask of the tokens that keep the output inside the language in well under a millisecond per token
(measured on this machine with the default model's 49,152-token vocabulary: 0.6 ms per token for a small
JSON schema, mask and apply included; compiling that schema took 7 ms once the vocabulary was indexed,
0.2 s per process). llguidance (Rust, also offered by vLLM) would do the job too; xgrammar is the default
that vLLM users' constraints are written against, and it compiles all six kinds here.

Where it runs: the router compiles each constraint once, in a worker process bounded in time and size
(router.grammar_pool), to refuse a bad one with a 400 that says why; the last stage compiles it again
(cached by its text) in a thread of its own when its scheduler asks (Stage.CompileGrammar: the request is not
scheduled until then, scheduler.grammar_wait), and keeps a matcher per sequence beside the sequence's other
sampling state (stage_worker.sampler), masks the row before sampling and advances the matcher with the token it
sampled. JSON comes out compact unless the constraint allows whitespace, and then in runs of at most
MAX_WHITESPACE_RUN. The scheduler sends the constraint once, with the sequence's sampling parameters.
"""
from __future__ import annotations

import json
import logging
import re
import threading
from collections import OrderedDict

from stagemesh.core.errors import StagemeshError
from stagemesh.core.sampling_params import InvalidParameter, StructuredOutputs

log = logging.getLogger("stagemesh")

CACHE_SIZE = 256  # compiled grammars kept per process, least recently used dropped
# JSON with any_whitespace: at most this many whitespace characters in a row between tokens (a newline and an
# indent several levels deep), so that a model that keeps choosing whitespace (xgrammar's default allows any
# run) cannot spend max_tokens on it; without any_whitespace the output is compact: ", " and ": " only
MAX_WHITESPACE_RUN = 16
_NOISE = re.compile(r"^\[[\d:]+\] \S+:\d+: ")  # xgrammar's "[hh:mm:ss] /path/file.cc:123: " prefix


class GrammarCompiler:
    """Compiles StructuredOutputs against one tokenizer; thread-safe, with an LRU cache of the results."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int] | None = None,
                 cache_size: int = CACHE_SIZE):
        import xgrammar

        self._xgr = xgrammar
        # the model's vocabulary may be padded past the tokenizer's: those ids are never allowed
        self.info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                            stop_token_ids=stop_token_ids or None)
        self.vocab_size = vocab_size
        self._compiler = xgrammar.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        self._cache: OrderedDict = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()

    def cached(self, s: StructuredOutputs):
        """The compiled grammar of `s` if the cache holds it, else None (never compiles)."""
        with self._lock:
            return self._cache.get(s.key)

    def compile(self, s: StructuredOutputs):
        """The compiled grammar of `s`; raises InvalidParameter (param structured_outputs) with the reason."""
        with self._lock:
            hit = self._cache.get(s.key)
            if hit is not None:
                self._cache.move_to_end(s.key)
                return hit
        compiled = self._compile(s)
        with self._lock:
            self._cache[s.key] = compiled
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, s: StructuredOutputs):
        c = self._compiler
        try:
            if s.kind == "json":
                try:
                    json.loads(s.text)
                except ValueError as err:
                    raise InvalidParameter("structured_outputs", f"the JSON schema is not JSON: {err}") from None
                return c.compile_json_schema(s.text, **_whitespace(s))
            if s.kind == "json_object":  # an object, as OpenAI's json_object means (and vLLM compiles it)
                return c.compile_json_schema('{"type": "object"}', **_whitespace(s))
            if s.kind == "regex":
                return c.compile_regex(s.text)
            if s.kind == "choice":  # one alternative per choice, each a literal
                return c.compile_grammar("root ::= " + " | ".join(json.dumps(x) for x in s.choices))
            if s.kind == "structural_tag":
                return self._structural_tag(s.text)
            return c.compile_grammar(s.text)
        except (RuntimeError, ValueError) as err:
            reason = _NOISE.sub("", str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__)
            raise InvalidParameter("structured_outputs", f"the {s.kind} constraint does not compile: "
                                                         f"{reason}") from None

    def _structural_tag(self, text: str):
        """vLLM's two spellings: {"structures": [{begin, schema, end}], "triggers": [...]} (as its
        response_format type structural_tag), or xgrammar's own structural-tag JSON."""
        try:
            tag = json.loads(text)
        except ValueError as err:
            raise InvalidParameter("structured_outputs", f"the structural tag is not JSON: {err}") from None
        if not isinstance(tag, dict) or "structures" not in tag:
            return self._compiler.compile_structural_tag(text)
        try:
            items = [self._xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
                     for s in tag["structures"]]
            triggers = [str(t) for t in tag["triggers"]]
        except (KeyError, TypeError) as err:
            raise InvalidParameter("structured_outputs", "a structural tag's structures are {begin, schema, end} "
                                                         f"and it has triggers ({type(err).__name__}: {err})") from None
        return self._compiler.compile_structural_tag(items, triggers)

    def matcher(self, compiled) -> "Matcher":
        return Matcher(self, compiled)


def _whitespace(s: StructuredOutputs) -> dict:
    if s.any_whitespace:
        return {"any_whitespace": True, "max_whitespace_cnt": MAX_WHITESPACE_RUN}
    return {"any_whitespace": False}


class Matcher:
    """One sequence's place in its grammar: the mask of the tokens that may come next, and the tokens
    that came."""

    def __init__(self, compiler: GrammarCompiler, compiled):
        xgr = compiler._xgr
        self._xgr = xgr
        self._m = xgr.GrammarMatcher(compiled)
        self._bitmask = xgr.allocate_token_bitmask(1, compiler.vocab_size)
        self.vocab_size = compiler.vocab_size

    def accept(self, token_id: int) -> bool:
        """Advance past `token_id`; False if the grammar does not allow it (the matcher is unchanged)."""
        return bool(self._m.accept_token(token_id))

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted (speculative decoding masks the rows after each draft, then
        comes back to accept the tokens verified)."""
        self._m.rollback(num_tokens)

    def mask(self, row) -> None:
        """Set every logit of `row` ([vocab]) that the grammar does not allow next to -inf, in place."""
        self._m.fill_next_token_bitmask(self._bitmask)
        bitmask = self._bitmask if row.device.type == "cpu" else self._bitmask.to(row.device, non_blocking=True)
        self._xgr.apply_token_bitmask_inplace(row.unsqueeze(0), bitmask, vocab_size=self.vocab_size)

    @property
    def terminated(self) -> bool:
        return bool(self._m.is_terminated())


def lazy_compiler(model_dir, vocab_size: int, stop_token_ids: list[int]):
    """A function that makes the GrammarCompiler of the model in `model_dir` on its first call (loading the
    tokenizer takes seconds) and returns the same one after; it raises StagemeshError without a tokenizer."""
    made: list[GrammarCompiler] = []
    lock = threading.Lock()

    def get() -> GrammarCompiler:
        with lock:
            if not made:
                from transformers import AutoTokenizer

                try:
                    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
                except (OSError, ValueError) as err:
                    raise StagemeshError(f"the model has no tokenizer to compile constraints with: {err}") from None
                made.append(GrammarCompiler(tokenizer, vocab_size, stop_token_ids))
                log.info("structured outputs: grammars compiled against %s's tokenizer", model_dir)
            return made[0]

    return get
