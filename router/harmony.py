"""gpt-oss's harmony format (--reasoning-parser openai_gptoss, vLLM's name), read from the answer's text: the
model writes messages, each a header and a body,
    <|channel|>analysis<|message|>...<|end|><|start|>assistant<|channel|>final<|message|>...
(the chat template opened the first with <|start|>assistant; <|return|> and <|call|> end the answer and are
its end-of-sequence tokens). The final channel is the answer; the messages before it (analysis, a commentary
preamble) are the reasoning, one line between them, as vLLM reads them. A commentary message to a tool
(`to=functions.NAME`) is a tool call, which is not read yet: requests with tools are refused under this parser
(router.request_builder), and one the model makes unasked is kept out of both (tool_messages). The router
decodes such answers with their special tokens (the headers are), and this splitter drops every control token.

Text streams through feed() as through router.reasoning.ReasoningSplit: a control token cut across deltas is
held back until it is whole."""
from __future__ import annotations

import re

MESSAGE, START = "<|message|>", "<|start|>"
ENDS = ("<|end|>", "<|return|>", "<|call|>", START)  # what ends a message's body
_CHANNEL = re.compile(r"<\|channel\|>\s*([A-Za-z_]+)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")


class HarmonySplit:
    """One choice's harmony text as it streams, split into (reasoning, content) deltas."""

    def __init__(self):
        self.state = "header"  # header (until <|message|>), body
        self.channel, self.recipient = "final", None  # the body's
        self.held = ""
        self.reasoning = ""
        self.content = ""
        self.opened = False  # an analysis message was read
        self.body = ""  # the body of a message to a tool so far
        self.fresh = True  # the message's body has given nothing yet
        self.tool_messages: list[tuple[str, str]] = []  # (recipient, body) of messages to tools: not served yet

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        buf, reasoning, content = self.held + text, "", ""
        while buf:
            if self.state == "header":
                head = buf.lstrip()
                if not final and "<|".startswith(head):
                    break  # (a control token may begin here)
                if not head.startswith("<|") and not self.opened and not self.content:
                    self.state = "body"  # (no header at all: the text is the answer, as a model without harmony)
                    continue
                at = buf.find(MESSAGE)
                if at < 0:
                    break
                header, buf = buf[:at], buf[at + len(MESSAGE):]
                channel, recipient = _CHANNEL.search(header), _RECIPIENT.search(header)
                self.channel = channel.group(1) if channel else "final"
                self.recipient = recipient.group(1) if recipient else None
                self.state, self.body, self.fresh = "body", "", True
                self.opened |= self.channel != "final" and self.recipient is None
                continue
            end = min((at for at in (buf.find(e) for e in ENDS) if at >= 0), default=-1)
            keep = 0 if final or end >= 0 else _partial_control(buf)
            piece = buf[:end] if end >= 0 else buf[:len(buf) - keep]
            r, c = self._route(piece, reasoning)
            reasoning, content = reasoning + r, content + c
            if end < 0:
                buf = buf[len(buf) - keep:]
                break
            self._close()
            tail = buf[end:]
            buf = tail[tail.index("|>") + 2:] if not tail.startswith(START) else tail
            self.state = "header"
        self.held = buf if not final else ""
        self.reasoning += reasoning
        self.content += content
        return reasoning, content

    def _route(self, piece: str, pending: str) -> tuple[str, str]:
        """Where a piece of a body goes (`pending`: reasoning this feed gave already)."""
        if self.recipient is not None:  # a message to a tool: its arguments, kept apart
            self.body += piece
            return "", ""
        if self.channel == "final":
            return "", piece
        if piece and self.fresh and (self.reasoning or pending):  # (one line between messages, as vLLM joins them)
            piece = "\n" + piece
        self.fresh = self.fresh and not piece
        return piece, ""

    def _close(self) -> None:
        if self.recipient is not None:
            self.tool_messages.append((self.recipient, self.body))

    def thinking(self) -> bool:
        """Whether the text fed next is not the answer (the final channel) yet."""
        return not (self.state == "body" and self.channel == "final")

    def result(self) -> tuple[str | None, str | None]:
        return (self.reasoning if self.opened else None), (self.content or None)


def _partial_control(text: str) -> int:
    """How many characters at the end of `text` may begin a control token (<|...|>): held back."""
    at = text.rfind("<")
    if at < 0:
        return 0
    tail = text[at:]
    return len(tail) if "|>" not in tail and (len(tail) == 1 or tail[1] == "|") else 0
