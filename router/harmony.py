"""gpt-oss's harmony format (--reasoning-parser openai_gptoss, vLLM's name), read from the answer's text: the
model writes messages, each a header and a body,
    <|channel|>analysis<|message|>...<|end|><|start|>assistant<|channel|>final<|message|>...
(the chat template opened the first with <|start|>assistant; <|return|> and <|call|> end the answer and are
its end-of-sequence tokens). The analysis channel is the reasoning; the final channel and commentary preambles
(commentary to no recipient: what the model tells the user before its calls) are the content, one line between
messages on each side, as vLLM's parse_chat_output reads them. A message to a function
    <|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>
(the recipient may come before the channel too) is a tool call, kept out of both and read as it streams into
`calls`: its name once the header is whole, then its arguments piece by piece (call_deltas, OpenAI's streamed
tool-call deltas); router.tools' `openai` parser gives them as tool_calls, as vLLM's parser of that name. A
call counts once its message is closed (<|call|>, or the output's end when not cut short by max_tokens), as
vLLM's harmony parser counts only finished messages. Messages to other recipients (gpt-oss's built-in browser
and python tools, which this server does not run) are kept out of everything. The router decodes such answers
with their special tokens (the headers are), and this splitter drops every control token.

Text streams through feed() as through router.reasoning.ReasoningSplit: a control token cut across deltas is
held back until it is whole."""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

MESSAGE, START = "<|message|>", "<|start|>"
ENDS = ("<|end|>", "<|return|>", "<|call|>", START)  # what ends a message's body
_CHANNEL = re.compile(r"<\|channel\|>\s*([A-Za-z_]+)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_CONSTRAIN = re.compile(r"<\|constrain\|>\s*([^\s<]+)")
FUNCTIONS = "functions."  # the recipient prefix of the request's tools


@dataclass
class HarmonyCall:
    """One call of a function, as its message streams."""
    name: str
    content_type: str | None  # <|constrain|>json: the arguments are JSON (gpt-oss writes it so)
    arguments: str = ""  # the message's body so far
    done: bool = False  # its message was closed: a call (cut short, it is none)
    id: str = field(default_factory=lambda: f"chatcmpl-tool-{uuid.uuid4().hex}")

    def json_arguments(self) -> str:
        """The arguments as vLLM gives them whole: JSON read and written again (compact, one line), or the text as
        the model wrote it when it is not JSON or not said to be."""
        if self.content_type is not None and "json" not in self.content_type:
            return self.arguments
        try:
            return json.dumps(json.loads(self.arguments), ensure_ascii=False)
        except ValueError:
            return self.arguments


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
        self.tool_messages: list[tuple[str, str]] = []  # (recipient, body) of messages to tools, closed
        self.calls: list[HarmonyCall] = []  # the messages to functions (the last may be open)
        self.call_deltas: list[dict] = []  # OpenAI's streamed tool-call deltas not taken yet (take_call_deltas)

    def feed(self, text: str, final: bool = False, cut: bool = False) -> tuple[str, str]:
        """The (reasoning, content) that `text` adds; `final`: the output ends here; `cut`: it was cut short
        (max_tokens), so that a call still open is none."""
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
                self.opened |= not self._visible() and self.recipient is None
                self._open(header)
                continue
            end = min((at for at in (buf.find(e) for e in ENDS) if at >= 0), default=-1)
            keep = 0 if final or end >= 0 else _partial_control(buf)
            piece = buf[:end] if end >= 0 else buf[:len(buf) - keep]
            r, c = self._route(piece, reasoning, content)
            reasoning, content = reasoning + r, content + c
            if end < 0:
                buf = buf[len(buf) - keep:]
                break
            self._close()
            tail = buf[end:]
            buf = tail[tail.index("|>") + 2:] if not tail.startswith(START) else tail
            self.state = "header"
        if final and self.state == "body" and not cut:
            self._close()  # (the output ended at its end-of-sequence token, whose text is not given)
        self.held = buf if not final else ""
        self.reasoning += reasoning
        self.content += content
        return reasoning, content

    def _route(self, piece: str, reasoning: str, content: str) -> tuple[str, str]:
        """Where a piece of a body goes (`reasoning`, `content`: what this feed gave already)."""
        if self.recipient is not None:  # a message to a tool: its arguments, kept apart
            self.body += piece
            if piece and self._calling():
                self.calls[-1].arguments += piece
                self.call_deltas.append({"index": len(self.calls) - 1, "function": {"arguments": piece}})
            return "", ""
        visible = self._visible()
        before = self.content + content if visible else self.reasoning + reasoning
        if piece and self.fresh and before:  # (one line between messages, as vLLM joins them)
            piece = "\n" + piece
        self.fresh = self.fresh and not piece
        return ("", piece) if visible else (piece, "")

    def _visible(self) -> bool:
        """Whether the message being read is the user's to see: the final channel, or a preamble (commentary to no
        recipient)."""
        return self.channel in ("final", "commentary")

    def _open(self, header: str) -> None:
        """A message to a function begins: its call, and the stream's first delta of it (id and name)."""
        if self.recipient is None or not self.recipient.startswith(FUNCTIONS):
            return
        constrain = _CONSTRAIN.search(header)
        call = HarmonyCall(self.recipient[len(FUNCTIONS):], constrain.group(1) if constrain else None)
        self.calls.append(call)
        self.call_deltas.append({"index": len(self.calls) - 1, "id": call.id, "type": "function",
                                 "function": {"name": call.name, "arguments": ""}})

    def _calling(self) -> bool:
        return bool(self.recipient and self.recipient.startswith(FUNCTIONS) and self.calls
                    and not self.calls[-1].done)

    def _close(self) -> None:
        if self.recipient is not None:
            if self._calling():
                self.calls[-1].done = True
            self.tool_messages.append((self.recipient, self.body))
            self.recipient = None  # (closed once: a later end of the output does not close it again)

    def take_call_deltas(self) -> list[dict]:
        """OpenAI's tool-call deltas since the last take: a call's index, id, type and name first (arguments ""),
        then its arguments as they come."""
        out, self.call_deltas = self.call_deltas, []
        return out

    def made_calls(self) -> list[HarmonyCall]:
        """The calls whose messages were closed."""
        return [c for c in self.calls if c.done]

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
