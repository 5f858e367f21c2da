"""A chat template rendered by transformers' own code (the function apply_chat_template calls), stopped as
soon as its output passes a size bound. Both renderers use it: the router's threads for the model's own
template, the worker processes (router.template_process) for a request's."""
from __future__ import annotations

from contextvars import ContextVar
from typing import Any, Iterable, cast

# the bound of the render running in this thread (None: no bound, jinja's own join)
_MAX_CHARS: ContextVar[int | None] = ContextVar("chat_template_max_chars", default=None)


class RenderTooLong(Exception):
    """The template wrote more than the bound: the render was stopped there."""

    def __init__(self, max_chars: int):
        super().__init__(f"the chat template wrote more than {max_chars:,} characters")
        self.max_chars = max_chars


def render_chat(template: str, messages: list[dict], tools: list | None, documents: list | None,
                add_generation_prompt: bool, continue_final_message: bool, kwargs: dict[str, Any],
                max_chars: int) -> str:
    """What tokenizer.apply_chat_template(messages, tokenize=False, ...) gives, byte for byte, for the chat
    template `template` (already chosen: tokenizer.get_chat_template) and `kwargs` (the tokenizer's special
    tokens, then the request's template kwargs, as apply_chat_template merges them); RenderTooLong past
    `max_chars` characters. Takes and gives JSON values only, so that a worker process can call it."""
    from transformers.utils import chat_template_utils as ctu

    _bound(ctu._compile_jinja_template(template))
    # (older transformers hand the messages over as they are, as their apply_chat_template does)
    normalize = getattr(ctu, "_normalize_chat_messages", lambda m: m)
    token = _MAX_CHARS.set(max_chars)
    try:
        # (the rendered conversations and their generation indices, whatever its annotation says)
        rendered, _ = cast("tuple[list[str], list]", ctu.render_jinja_template(
            [normalize(messages)], tools=tools, documents=documents, chat_template=template,
            add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message, **kwargs))
    finally:
        _MAX_CHARS.reset(token)
    return rendered[0]


def _bound(compiled) -> None:
    """Jinja's Template.render joins the chunks its template generates with environment.concat: the
    environment of transformers' compiled template (one per template text, cached) joins them here instead,
    counting as it goes, so that a template printing without end stops at the bound rather than at the
    memory's end. Its output is the same join of the same chunks."""
    if compiled.environment.concat is not _bounded_join:
        compiled.environment.concat = _bounded_join


def _bounded_join(chunks: Iterable[str]) -> str:
    limit = _MAX_CHARS.get()
    if limit is None:
        return "".join(chunks)
    out: list[str] = []
    size = 0
    try:
        for chunk in chunks:
            size += len(chunk)
            if size > limit:
                raise RenderTooLong(limit)
            out.append(chunk)
    finally:
        close = getattr(chunks, "close", None)
        if close is not None:
            close()  # the template's generator stops here, not when the collector finds it
    return "".join(out)
