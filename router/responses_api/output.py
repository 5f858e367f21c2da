"""A Responses API response, built from the deltas of its one generation: the whole object (OpenAI's
Response, vLLM's values), or a stream's events (response.created, output items and their parts, text and
function-call argument deltas, response.completed or response.incomplete), numbered in order.

Under --reasoning-parser the model's thinking comes first, as a reasoning item (reasoning_text content; its
deltas stream as response.reasoning_text.delta), then the message. Text streams as it comes; with tools,
under tool_choice "auto" it is held back only where a call may begin (the router's --tool-call-parser), under
"required" or a named function the calls are the whole output; under gpt-oss's harmony format (the openai
parser) the text is the final channel's, the calls its messages to functions. The calls come as function_call
items once the output is complete.
"""
from __future__ import annotations

import uuid

from router.dispatch import Generation
from router.generation import Delta
from router.harmony import HarmonySplit
from router.request import GenerateRequest
from router.responses import Choice, token_logprobs
from router.responses_api.request import ResponsesRequest
from router.tokenization import Tokenizer
from router.tools import HarmonyParser, ToolCall, read_calls


class ResponseBuilder:
    def __init__(self, m: ResponsesRequest, req: GenerateRequest, response_id: str, created: int, gen: Generation,
                 tokenizer: Tokenizer):
        self.m, self.req, self.id, self.created, self.tokenizer = m, req, response_id, created, tokenizer
        self.choice = Choice(gen, split=req.reasoning.splitter() if req.reasoning else None)
        # the same on every router: a resumed stream's items are the ones its client was told of
        self.message_id = "msg_" + response_id.removeprefix("resp_")
        self.reasoning_id = "rs_" + response_id.removeprefix("resp_")
        self.sequence = 0
        self.opened = False  # a stream announced the message item
        self.thinking = False  # a stream announced the reasoning item
        self.thought = False  # ... and closed it
        self.sent = 0  # characters of text a stream has sent
        self.stored = m.store  # False once a store: true response could not be kept (the store failed)
        self.background = m.background
        self.quiet_reasoning = False  # a response taken over (background): its reasoning deltas were sent
        self._final: tuple[str | None, list[tuple[str, ToolCall]]] | None = None

    # -- the answer --------------------------------------------------------------------------------
    def add(self, d: Delta) -> str:
        """Take a delta; return the reasoning text it adds."""
        return self.choice.add(d)[0]

    def reasoning_text(self) -> str:
        """The answer's reasoning so far ("" without one)."""
        return self.choice.reasoning().get("reasoning") or ""

    def final(self) -> tuple[str | None, list[tuple[str, ToolCall]]]:
        """(the message's text, [(item id, call)]) of the finished answer."""
        if self._final is None:
            c = self.choice
            made = read_calls(self.req.tool_plan, c.content, c.finish_reason,
                              c.split if isinstance(c.split, HarmonySplit) else None)
            content, calls = made if made else (c.content, [])
            self._final = content, [(f"fc_{uuid.uuid4().hex}", call) for call in calls]
        return self._final

    def turn(self) -> dict:
        """The answer as the assistant's chat message, for the conversation a later request continues."""
        content, calls = self.final()
        turn: dict[str, object] = {"role": "assistant", "content": (content or None) if calls else (content or "")}
        if calls:
            turn["tool_calls"] = [call.to_dict() for _, call in calls]
        return turn

    def body(self, status: str | None = None) -> dict:
        """The Response object: finished (status from the answer), or a snapshot with `status` and no output."""
        m = self.m
        out = {"id": self.id, "object": "response", "created_at": self.created, "status": status, "error": None,
               "incomplete_details": None, "instructions": m.instructions, "max_output_tokens": m.max_output_tokens,
               "model": self.req.model, "output": [], "parallel_tool_calls": m.parallel_tool_calls is not False,
               "previous_response_id": m.previous_response_id, "reasoning": {"effort": None, "summary": None},
               "store": self.stored, "temperature": 1.0 if m.temperature is None else m.temperature,
               "text": {"format": (m.text or {}).get("format") or {"type": "text"}},
               "tool_choice": m.tool_choice or "auto", "tools": m.tools or [],
               "top_p": 1.0 if m.top_p is None else m.top_p, "top_logprobs": m.top_logprobs or 0,
               "truncation": "disabled", "usage": None, "user": m.user, "metadata": m.metadata or {},
               "background": self.background, "max_tool_calls": None, "service_tier": "default"}
        if status is None:
            out["status"], out["incomplete_details"] = self._status()
            out["output"], out["usage"] = self._output(), self._usage()
        return out

    def _status(self) -> tuple[str, dict | None]:
        if self.choice.finish_reason == "length" and not self.final()[1]:
            return "incomplete", {"reason": "max_output_tokens"}
        return "completed", None

    def _output(self) -> list[dict]:
        content, calls = self.final()
        thought = self.reasoning_text()
        items = [self._reasoning(thought, "completed")] if thought else []
        items += [self._message(content or "", self._message_status())] if content or self.opened else []
        return items + [self._call(item_id, call, "completed") for item_id, call in calls]

    def _reasoning(self, text: str, status: str, content: bool = True) -> dict:
        return {"id": self.reasoning_id, "type": "reasoning", "summary": [], "status": status,
                "content": [{"type": "reasoning_text", "text": text}] if content else [], "encrypted_content": None}

    def _message_index(self) -> int:
        """The message item's place in the output: after the reasoning item, where there is one."""
        return 1 if self.thinking or (self.choice.finish_reason and self.reasoning_text()) else 0

    def _message_status(self) -> str:
        """The message item's status: incomplete with the response (cut at max_output_tokens), as OpenAI's."""
        return "incomplete" if self._status()[0] == "incomplete" else "completed"

    def _usage(self) -> dict:
        gen = self.choice.gen
        return {"input_tokens": len(gen.prompt_ids), "input_tokens_details": {"cached_tokens": gen.cached_tokens},
                "output_tokens": gen.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": self.choice.reasoning_tokens},
                "total_tokens": len(gen.prompt_ids) + gen.completion_tokens}

    def _message(self, text: str, status: str, content: bool = True) -> dict:
        return {"id": self.message_id, "type": "message", "role": "assistant", "status": status,
                "content": [self._part(text)] if content else []}

    def _part(self, text: str) -> dict:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": self._logprobs(text)}

    def _logprobs(self, text: str) -> list:
        # every token's, when the text is the whole output (not the text before calls the parser split off)
        c = self.choice
        return token_logprobs(c.logprobs, self.tokenizer.token_text) if self.req.logprobs and text == c.text else []

    @staticmethod
    def _call(item_id: str, call: ToolCall, status: str, arguments: str | None = None) -> dict:
        return {"id": item_id, "type": "function_call", "call_id": call.id, "name": call.name,
                "arguments": call.arguments if arguments is None else arguments, "status": status}

    # -- a stream's events ---------------------------------------------------------------------------
    def event(self, kind: str, **fields) -> dict:
        self.sequence += 1
        return {"type": kind, "sequence_number": self.sequence - 1, **fields}

    def opening(self) -> list[dict]:
        snapshot = self.body(status="in_progress")
        return [self.event("response.created", response=snapshot),
                self.event("response.in_progress", response=snapshot)]

    def deltas(self, d: Delta) -> list[dict]:
        """The events of one delta: the reasoning it adds, the text that may be shown now."""
        reasoning = self.add(d)
        events = self._think(reasoning) if reasoning and not self.quiet_reasoning else []
        if d.finish_reason:
            return events  # the rest comes with the closing events, once the calls are read
        visible = self._visible()
        if visible <= self.sent:
            return events
        text, self.sent = self.choice.content[self.sent:visible], visible
        logprobs = token_logprobs(d.logprobs, self.tokenizer.token_text) if self.req.logprobs else []
        return events + self._open() + [self._text_delta(text, logprobs)]

    def _think(self, text: str) -> list[dict]:
        """A reasoning delta (the reasoning item announced first)."""
        events = []
        if not self.thinking:
            self.thinking = True
            events += [self.event("response.output_item.added", output_index=0,
                                  item=self._reasoning("", "in_progress", content=False)),
                       self.event("response.content_part.added", item_id=self.reasoning_id, output_index=0,
                                  content_index=0, part={"type": "reasoning_text", "text": ""})]
        return events + [self.event("response.reasoning_text.delta", item_id=self.reasoning_id, output_index=0,
                                    content_index=0, delta=text)]

    def _thought(self) -> list[dict]:
        """The reasoning item's end, once (before the message opens, or at the close)."""
        if not self.thinking or self.thought:
            return []
        self.thought, text = True, self.reasoning_text()
        where = dict(item_id=self.reasoning_id, output_index=0, content_index=0)
        return [self.event("response.reasoning_text.done", **where, text=text),
                self.event("response.content_part.done", **where, part={"type": "reasoning_text", "text": text}),
                self.event("response.output_item.done", output_index=0, item=self._reasoning(text, "completed"))]

    def _visible(self) -> int:
        plan, text = self.req.tool_plan, self.choice.content
        if plan is None or plan.mode == "none":
            return len(text)
        parser = plan.parser if plan.mode == "auto" else None
        if isinstance(parser, HarmonyParser):  # (the calls are kept out of the content as they stream)
            return len(text)
        return parser.may_start(text) if parser is not None else 0

    def _open(self) -> list[dict]:
        if self.opened:
            return []
        events, self.opened = self._thought(), True
        index = self._message_index()
        return events + [self.event("response.output_item.added", output_index=index,
                                    item=self._message("", "in_progress", content=False)),
                         self.event("response.content_part.added", item_id=self.message_id, output_index=index,
                                    content_index=0,
                                    part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})]

    def _text_delta(self, text: str, logprobs: list) -> dict:
        return self.event("response.output_text.delta", item_id=self.message_id, output_index=self._message_index(),
                          content_index=0, delta=text, logprobs=logprobs)

    def closing(self) -> list[dict]:
        """The rest of the text, the message's end, the calls, and the finished response."""
        content, calls = self.final()
        events = []
        if content and len(content) > self.sent:
            events += self._open() + [self._text_delta(content[self.sent:], [])]
        events += self._thought()
        index = self._message_index()
        if self.opened:
            text = content or ""
            part = self._part(text)
            where = dict(item_id=self.message_id, output_index=index, content_index=0)
            events += [self.event("response.output_text.done", **where, text=text, logprobs=part["logprobs"]),
                       self.event("response.content_part.done", **where, part=part),
                       self.event("response.output_item.done", output_index=index,
                                   item=self._message(text, self._message_status()))]
        first = index + 1 if self.opened else index
        for k, (item_id, call) in enumerate(calls):
            index = first + k
            events += [self.event("response.output_item.added", output_index=index,
                                   item=self._call(item_id, call, "in_progress", arguments="")),
                       self.event("response.function_call_arguments.delta", item_id=item_id, output_index=index,
                                   delta=call.arguments),
                       self.event("response.function_call_arguments.done", item_id=item_id, output_index=index,
                                   name=call.name, arguments=call.arguments),
                       self.event("response.output_item.done", output_index=index,
                                   item=self._call(item_id, call, "completed"))]
        body = self.body()
        events.append(self.event("response.completed" if body["status"] == "completed" else "response.incomplete",
                                  response=body))
        return events
