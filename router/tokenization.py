"""Text lives in the router: tokenizing, the chat template, incremental
detokenizing and stop strings. The scheduler sees token ids only."""
from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, TypeVar

from router.errors import APIError, bad_request
from stagemesh.errors import StagemeshError

T = TypeVar("T")


class Tokenizer:
    """The model's tokenizer; long work (encoding a prompt, a chat template, decoding a long list) goes
    through run(), on a thread of its own (the fast tokenizer releases the GIL), so that the event loop
    keeps serving other requests and /health meanwhile."""

    MAX_QUEUED = 256

    def __init__(self, model_dir: str | Path, max_positions: int | None = None):
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(model_dir)
        # no token is longer than this many characters, so a text longer than max_positions of them can
        # never fit the model: refused before it costs seconds of tokenizing
        longest = max((len(t) for t in self.tok.convert_ids_to_tokens(list(range(len(self.tok)))) if t), default=1)
        self.max_text_chars = (max_positions or 1 << 20) * max(longest, 1)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="tokenizer")
        self._queued = 0

    async def run(self, fn: Callable[..., T], *args) -> T:
        if self._queued >= self.MAX_QUEUED:
            raise APIError(503, f"the tokenizer has {self._queued} texts queued; try again shortly",
                           code="unavailable", retry_after=1)
        loop = asyncio.get_running_loop()
        self._queued += 1
        work = self._pool.submit(fn, *args)
        # counted until the work itself ends (or is cancelled before it starts), not until its caller goes
        work.add_done_callback(lambda _: loop.call_soon_threadsafe(self._done))
        return await asyncio.wrap_future(work)

    def _done(self) -> None:
        self._queued -= 1

    def check_length(self, num_chars: int, param: str) -> None:
        if num_chars > self.max_text_chars:
            raise bad_request(f"'{param}' has {num_chars:,} characters: more than any prompt this model can take "
                              f"({self.max_text_chars:,} characters at most)", param)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tok.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        if not self.tok.chat_template:
            raise StagemeshError("this model has no chat template; use /v1/completions")
        out = self.tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True,
                                           return_dict=True)
        return list(out["input_ids"])

    def token_text(self, token_id: int) -> str:
        return self.tok.decode([token_id])

    @property
    def vocab_size(self) -> int:
        return len(self.tok)


class IncrementalDetokenizer:
    """Text deltas whose concatenation is exactly decode(all ids).

    Decoding a window of recent ids and emitting only what is past the
    previously emitted text handles multi-token characters and the
    tokenizer's spacing rules; an incomplete UTF-8 character ("\ufffd") is
    held back until the next token completes it.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self.text = ""

    def add(self, token_ids: list[int]) -> str:
        self.ids.extend(token_ids)
        full = self.tokenizer.decode(self.ids, skip_special_tokens=self.skip)
        if full.endswith("\ufffd"):
            return ""
        delta = full[len(self.text):] if full.startswith(self.text) else full
        self.text = full
        return delta


class StopStrings:
    """Applies stop strings to streamed text, never leaking a stop string.

    Holds back the tail that could still be the start of a stop string.
    """

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.pending = ""
        self.stopped: str | None = None

    def feed(self, delta: str) -> str:
        """Text that may be sent now; sets `stopped` when a stop string appeared."""
        if self.stopped is not None:
            return ""
        self.pending += delta
        cut = min(((self.pending.find(s), s) for s in self.stops if s in self.pending), default=None)
        if cut is not None:
            self.stopped = cut[1]
            out, self.pending = self.pending[:cut[0]], ""
            return out
        if not self.hold:
            out, self.pending = self.pending, ""
            return out
        out, self.pending = self.pending[:-self.hold], self.pending[-self.hold:]
        return out

    def flush(self) -> str:
        out, self.pending = ("" if self.stopped is not None else self.pending), ""
        return out
