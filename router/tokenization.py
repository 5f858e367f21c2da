"""Text lives in the router: tokenizing, the chat template, incremental
detokenizing and stop strings. The scheduler sees token ids only."""
from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, TypeVar

from router.errors import APIError, bad_request
from router.grammar_pool import GrammarChecks
from router.request import ChatOptions
from router.template_pool import TemplatePool
from router.template_render import RenderTooLong, render_chat

T = TypeVar("T")
TRUST_FLAG = "--trust-request-chat-template"


def num_threads() -> int:
    """Threads for texts: at least two, so that one long text does not queue every other behind it; the
    fast tokenizer releases the GIL, so more than the cores would only contend."""
    return max(2, min(4, os.cpu_count() or 2))


class Tokenizer:
    """The model's tokenizer; long work (encoding a prompt, the model's chat template, decoding a long list) goes
    through run(), on a few threads of their own, so that the event loop keeps serving other requests and
    /health meanwhile. A request's own chat template is refused unless `template_timeout_s` is given (the
    router's --trust-request-chat-template), and then runs in a worker process (router.template_pool)."""

    MAX_QUEUED = 256

    def __init__(self, model_dir: str | Path, max_positions: int | None = None,
                 template_timeout_s: float | None = None, grammar_timeout_s: float = 5.0,
                 json_any_whitespace: bool = False):
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(model_dir)
        # no token is longer than this many characters, so a text longer than max_positions of them can
        # never fit the model: refused before it costs seconds of tokenizing
        longest = max((len(t) for t in self.tok.convert_ids_to_tokens(list(range(len(self.tok)))) if t), default=1)
        self.max_text_chars = (max_positions or 1 << 20) * max(longest, 1)
        self.max_tokens = max_positions or 1 << 20  # no sequence of the model is longer (/detokenize's bound)
        # an encode before any thread runs: it leaves the backend with no truncation or padding to reset later
        # (a reset borrows the Rust tokenizer mutably, which fails while another thread encodes)
        self.tok.encode("")
        self._pool = ThreadPoolExecutor(num_threads(), thread_name_prefix="tokenizer")
        self._queued = 0
        # requests' output constraints, compiled in worker processes to refuse a bad one early
        self.grammars = GrammarChecks(str(model_dir), grammar_timeout_s, json_any_whitespace)
        self.request_templates = (TemplatePool(template_timeout_s, self.max_text_chars)
                                  if template_timeout_s is not None else None)

    async def start(self) -> None:
        if self.request_templates is not None:
            await self.request_templates.start()

    async def close(self) -> None:
        await self.grammars.close()
        if self.request_templates is not None:
            await self.request_templates.close()

    async def run(self, fn: Callable[..., T], *args) -> T:
        if self._queued >= self.MAX_QUEUED:
            raise APIError(503, f"the tokenizer has {self._queued} texts queued; try again shortly", retry_after=1)
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

    def check_token_count(self, num_tokens: int, param: str) -> None:
        if num_tokens > self.max_tokens:
            raise bad_request(f"'{param}' has {num_tokens:,} token ids: more than any sequence this model takes "
                              f"({self.max_tokens:,} at most)", param)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tok.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: list[int], skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True
               ) -> str:
        # (transformers types decode as str | list[str], the latter for batches: one list of ids is one str)
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens,  # type: ignore[return-value]
                               spaces_between_special_tokens=spaces_between_special_tokens)

    async def render_chat(self, options: ChatOptions) -> str:
        """The conversation as the chat template writes it, at most max_text_chars characters (a 400 past
        them: the render stops there, before anything is tokenized).

        The model's own template is the operator's, as trusted as the model: it renders here, on the
        tokenizer's threads, bounded in size only (a thread cannot be stopped, and it needs no stopping). A
        request's own template is anyone's code: refused without --trust-request-chat-template (vLLM's rule),
        and with it rendered in a worker process, bounded in size (the worker stops the render) and in time
        (the worker is killed)."""
        if options.chat_template is not None and self.request_templates is None:
            raise bad_request(f"'chat_template' given in the request, but the server does not run requests' own chat "
                              f"templates: start the router with {TRUST_FLAG} to allow them (vLLM's rule)",
                              "chat_template")
        if not (options.chat_template or self.tok.chat_template):
            raise bad_request("this model has no chat template; give 'chat_template' or use /v1/completions",
                              "messages")
        job = self._template_job(options)
        if self.request_templates is not None and options.chat_template is not None:
            return await self.request_templates.render(job)
        try:
            return await self.run(lambda: render_chat(**job, max_chars=self.max_text_chars))
        except RenderTooLong:
            raise bad_request(f"the chat template wrote more than {self.max_text_chars:,} characters for these "
                              "messages: more than any prompt this model can take", "messages") from None

    def _template_job(self, options: ChatOptions) -> dict:
        """router.template_render.render_chat's arguments (JSON values) for apply_chat_template's render of
        `options`: the template it would choose, the special tokens under the request's own kwargs."""
        kwargs = dict(options.template_kwargs)
        tools = kwargs.pop("tools", None)
        return {"template": self.tok.get_chat_template(options.chat_template, tools), "messages": options.messages,
                "tools": tools, "documents": options.documents,
                "add_generation_prompt": options.add_generation_prompt,
                "continue_final_message": options.continue_final_message,
                "kwargs": {**self.tok.special_tokens_map, **kwargs}}

    def token_text(self, token_id: int) -> str:
        return self.tok.decode([token_id])  # type: ignore[return-value]

    @property
    def vocab_size(self) -> int:
        return len(self.tok)


class IncrementalDetokenizer:
    """Text deltas whose concatenation is decode(all ids), in time independent of the output's length.

    Each step decodes only a window: the tokens from the last emitted boundary on, beside the same
    window without the new tokens; the difference is the new text (a tokenizer's spacing rules see
    the tokens before). An incomplete UTF-8 character ("\ufffd") is held back until the next token
    completes it.
    """

    CONTEXT = 5  # prompt tokens the first window starts with (vLLM's initial offset)

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True, prompt_ids: Sequence[int] = ()):
        self.tokenizer = tokenizer
        self.options = {"skip_special_tokens": skip_special_tokens,
                        "spaces_between_special_tokens": spaces_between_special_tokens}
        # the prompt's last tokens are the first window's context, so that the first token's text is what
        # it is after the prompt (a leading space, say), as vLLM's text is
        self.ids: list[int] = list(prompt_ids[-self.CONTEXT:])
        self.prefix, self.read = 0, len(self.ids)  # ids[prefix:read] were emitted; the window starts at prefix

    def add(self, token_ids: list[int]) -> str:
        self.ids.extend(token_ids)
        before = self.tokenizer.decode(self.ids[self.prefix:self.read], **self.options)
        after = self.tokenizer.decode(self.ids[self.prefix:], **self.options)
        if after.endswith("\ufffd") or len(after) <= len(before):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return after[len(before):]


class StopStrings:
    """Applies stop strings to streamed text, never leaking a stop string.

    Holds back the tail that could still be the start of a stop string.
    """

    def __init__(self, stops: list[str], include: bool = False):
        self.stops = [s for s in stops if s]
        self.include = include  # include_stop_str_in_output: the stop string ends the text
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
            out, self.pending = self.pending[:cut[0] + (len(cut[1]) if self.include else 0)], ""
            return out
        if not self.hold:
            out, self.pending = self.pending, ""
            return out
        out, self.pending = self.pending[:-self.hold], self.pending[-self.hold:]
        return out

    def flush(self) -> str:
        out, self.pending = ("" if self.stopped is not None else self.pending), ""
        return out
