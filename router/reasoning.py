"""Reasoning parsers (--reasoning-parser, vLLM's names): where a reasoning model's thinking ends and its answer
begins, so that chat completions give the thinking as `reasoning` / `reasoning_content` (the Responses API as a
reasoning item) and only the answer as `content`.

deepseek_r1 and qwen3 read `<think> ... </think>`, as vLLM's parsers do: an opening `<think>` (with any
whitespace before it) is dropped, the text up to `</think>` is the reasoning and the text after it the answer
(None when empty); an output that never closes its thinking (cut short by max_tokens) is all reasoning. Both
also take an output that does not open with `<think>` as thinking when the chat template opens the block
itself (DeepSeek-R1's and Qwen3-2507's end the prompt with `<think>`): that is, when the template mentions the
tags. A model whose template has no thinking part answers as it would without the parser. qwen3 honours the
template's switch: chat_template_kwargs {"enable_thinking": false} makes the output all answer (the template
closes an empty block in the prompt).

openai_gptoss reads gpt-oss's harmony channels instead (router.harmony): analysis is the reasoning, final the
answer; the answer is decoded with its special tokens for it.

The text is split as it streams (ReasoningSplit): a tag cut across two deltas is held back until it is whole,
so a stream's reasoning and content deltas add up to the whole answer's.
"""
from __future__ import annotations

from dataclasses import dataclass

from router.harmony import HarmonySplit

START, END = "<think>", "</think>"
HARMONY = "openai_gptoss"  # gpt-oss's harmony channels (router.harmony)
REASONING_PARSERS = ("deepseek_r1", "qwen3", HARMONY)


@dataclass(frozen=True)
class ReasoningPlan:
    """How one chat request's output is split (None on the request: not at all)."""
    parser: str
    implicit: bool  # text before </think> is reasoning even without an opening <think> (the template opened it)
    include: bool = True  # include_reasoning: the reasoning is returned (else dropped, the content kept)

    def splitter(self) -> "Splitter":
        return HarmonySplit() if self.parser == HARMONY else ReasoningSplit(self.implicit)


def template_thinks(chat_template) -> bool:
    """Whether a chat template has a thinking part (it opens, closes or strips <think> blocks)."""
    text = "\n".join(map(str, chat_template.values())) if isinstance(chat_template, dict) else chat_template or ""
    return START in text or END in text


def plan(parser: str | None, thinks: bool, template_kwargs: dict, include: bool) -> ReasoningPlan | None:
    """The request's plan under the router's --reasoning-parser (None: no parser); `thinks`: its chat template
    has a thinking part (template_thinks)."""
    if parser is None:
        return None
    implicit = thinks or parser == HARMONY  # (a harmony answer opens in its analysis channel)
    if parser == "qwen3" and template_kwargs.get("enable_thinking", True) is False:
        implicit = False  # (the template closed an empty block: the output is the answer)
    return ReasoningPlan(parser, implicit, include)


class ReasoningSplit:
    """One choice's text as it streams, split into (reasoning, content) deltas."""

    def __init__(self, implicit: bool):
        self.implicit = implicit
        self.state = "head"  # head (an opening <think> may still come), reasoning, content
        self.held = ""  # text not given out yet: a tag may begin in it
        self.reasoning = ""
        self.content = ""
        self.opened = False  # the output thought (an opening tag, or implicit thinking)

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """The (reasoning, content) that `text` adds; `final`: the output ends here (nothing is held back)."""
        buf, reasoning, content = self.held + text, "", ""
        while True:
            if self.state == "head":
                head = buf.lstrip()
                if head.startswith(START):
                    buf, self.state, self.opened = head[len(START):], "reasoning", True
                    continue
                if not final and START.startswith(head):  # (all whitespace, or <think> cut short)
                    break
                self.state = "reasoning" if self.implicit else "content"
                self.opened = self.implicit
                continue
            if self.state == "reasoning":
                at = buf.find(END)
                if at >= 0:
                    reasoning, buf, self.state = reasoning + buf[:at], buf[at + len(END):], "content"
                    continue
                keep = 0 if final else _partial(buf, END)
                reasoning, buf = reasoning + buf[:len(buf) - keep], buf[len(buf) - keep:]
                break
            content, buf = content + buf, ""
            break
        self.held = buf
        self.reasoning += reasoning
        self.content += content
        return reasoning, content

    def thinking(self) -> bool:
        """Whether the text fed next is not the answer yet (its tokens count as reasoning tokens)."""
        return self.state != "content"

    def result(self) -> tuple[str | None, str | None]:
        """The whole answer's (reasoning, content), as vLLM's message gives them: reasoning None when the output
        did not think, content None when empty."""
        return (self.reasoning if self.opened else None), (self.content or None)


def _partial(text: str, tag: str) -> int:
    """How many characters at the end of `text` may be the start of `tag` (to hold back)."""
    for keep in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-keep:]):
            return keep
    return 0


Splitter = ReasoningSplit | HarmonySplit  # what splits one choice's text as it streams
