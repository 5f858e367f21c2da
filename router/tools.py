"""Tool calling as vLLM does it without a tool-call parser: `tools` go to the chat template, and
`tool_choice` "required" or a named function forces valid calls through the JSON-schema constraint
(stagemesh.core.grammar), whatever the model; the constrained output is read back into OpenAI's
`tool_calls` (router.responses). "none" lets the model answer in text.

"auto" (OpenAI's default when tools are given) lets the model decide, in its own format, which the
router's --tool-call-parser reads back (hermes, llama3_json, openai for gpt-oss's harmony format; chosen from
the chat template unless the flags say, router.tool_parser_choice); without a parser it gets vLLM's 400.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from router.harmony import HarmonySplit
from stagemesh.core.sampling_params import InvalidParameter, StructuredOutputs

AUTO_REFUSED = ('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set (this '
                'server was started without them; or use tool_choice "required" or a named function)')


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=lambda: f"chatcmpl-tool-{uuid.uuid4().hex}")

    def to_dict(self, index: int | None = None) -> dict:
        out: dict[str, object]
        out = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:
            out["index"] = index
        return out


@dataclass
class ToolPlan:
    """What a chat request's tools ask of the generation and how its output is read."""
    tools: list[dict]  # the request's tools, for the chat template
    mode: str  # "none": text answers; "required": one or more calls; "named": a call of `name`; "auto": the
    # model decides, in its own format, which `parser` reads
    name: str | None = None
    parallel: bool = True
    parser: HermesParser | Llama3JsonParser | HarmonyParser | None = None  # under "auto"

    @property
    def constraint(self) -> StructuredOutputs | None:
        # compact JSON whatever the server's default: a call has no whitespace to run away on
        if self.mode == "named":
            assert self.name is not None  # (named: tool_choice names the function)
            return StructuredOutputs("json", json.dumps(self._parameters(self.name)), any_whitespace=False)
        if self.mode == "required":
            calls = {"anyOf": [{"type": "object", "properties": {"name": {"type": "string", "enum": [t["name"]]},
                                                                  "parameters": self._parameters(t["name"])},
                                "required": ["name", "parameters"]} for t in self._functions()]}
            schema = {"type": "array", "minItems": 1, "items": calls}
            if not self.parallel:
                schema["maxItems"] = 1
            return StructuredOutputs("json", json.dumps(schema), any_whitespace=False)
        return None

    def parse(self, text: str) -> list[ToolCall] | None:
        """The calls a finished constrained output makes; None if it is not one (cut short by max_tokens)."""
        try:
            value = json.loads(text)
        except ValueError:
            return None
        if self.mode == "named":
            assert self.name is not None
            return [ToolCall(self.name, json.dumps(value, ensure_ascii=False))]
        return [ToolCall(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in value]

    def _functions(self) -> list[dict]:
        return [t["function"] for t in self.tools]

    def _parameters(self, name: str) -> dict:
        fn = next(f for f in self._functions() if f["name"] == name)
        return fn.get("parameters") or {"type": "object", "properties": {}}


def read_calls(plan: ToolPlan | None, text: str, finish_reason: str | None, harmony: HarmonySplit | None = None
               ) -> tuple[str | None, list[ToolCall]] | None:
    """(content, tool calls) of a finished answer that made calls, else None: under "auto" what the tool-call
    parser reads in its text (the openai parser: in the answer's harmony messages, `harmony`); under
    tool_choice required / named its constrained JSON, or (None, []) when it was cut short (max_tokens, a stop
    string): partial JSON is no answer, the finish_reason says why."""
    if plan is None or plan.mode == "none":
        return None
    if plan.mode == "auto":
        assert plan.parser is not None  # (auto: the --tool-call-parser's)
        if isinstance(plan.parser, HarmonyParser):
            assert harmony is not None  # (the openai parser runs with the harmony splitter: router.request_builder)
            split = plan.parser.read(harmony, plan.parallel)
        else:
            split = plan.parser.split(text)
        return (split[0] or None, split[1]) if split else None
    calls = plan.parse(text) if finish_reason == "stop" else None
    return (None, calls or [])


def plan_tools(tools: list[dict] | None, tool_choice, parallel_tool_calls: bool | None,
               tool_call_parser: str | None = None) -> ToolPlan | None:
    """The request's ToolPlan (None without tools and tool_choice); raises InvalidParameter as vLLM refuses.
    `tool_call_parser`: the router's --tool-call-parser when --enable-auto-tool-choice is set."""
    if tool_choice is not None and not tools and tool_choice != "none":
        raise InvalidParameter("tool_choice", "'tool_choice' other than \"none\" needs 'tools'")
    if not tools:
        return None
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict) \
                or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise InvalidParameter("tools", f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., "
                                            "'parameters': {...}}}}")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise InvalidParameter("tools", f"tools[{i}].function.parameters must be a JSON schema object")
    names = [t["function"]["name"] for t in tools]
    parallel = parallel_tool_calls is not False
    if tool_choice in (None, "auto"):  # OpenAI's default with tools is "auto"
        if tool_call_parser is None:
            raise InvalidParameter("tool_choice", AUTO_REFUSED)
        return ToolPlan(tools, "auto", parallel=parallel, parser=TOOL_CALL_PARSERS[tool_call_parser]())
    if tool_choice == "none":
        return ToolPlan(tools, "none", parallel=parallel)
    if tool_choice == "required":
        return ToolPlan(tools, "required", parallel=parallel)
    if isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name") if tool_choice.get("type") == "function" else None
        if not isinstance(name, str):
            raise InvalidParameter("tool_choice", "a named 'tool_choice' is {'type': 'function', 'function': "
                                                  "{'name': ...}}")
        if name not in names:
            raise InvalidParameter("tool_choice", f"tool_choice names the function {name!r}, which is not in "
                                                  "'tools'")
        return ToolPlan(tools, "named", name=name, parallel=parallel)
    raise InvalidParameter("tool_choice", "'tool_choice' must be \"none\", \"auto\", \"required\" or "
                                          "{'type': 'function', 'function': {'name': ...}}")


# -- tool_choice "auto": the model's own call format, parsed from its text (--tool-call-parser) ------------

class HermesParser:
    """Hermes' format (Qwen, Hermes, many fine-tunes): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
    one block per call, after any text; SmolLM2's block holds a list of such calls."""
    START, END = "<tool_call>", "</tool_call>"

    def split(self, text: str) -> tuple[str, list[ToolCall]] | None:
        """(content before the calls, calls), or None when the text makes no call."""
        if self.START not in text:
            return None
        content, _, rest = text.partition(self.START)
        calls = []
        for block in (self.START + rest).split(self.START)[1:]:
            body = block.split(self.END)[0].strip()
            try:
                value = json.loads(body)
                for call in value if isinstance(value, list) else [value]:  # SmolLM2: a list in one block
                    calls.append(ToolCall(call["name"], json.dumps(call.get("arguments", {}), ensure_ascii=False)))
            except (ValueError, KeyError, TypeError):
                return None  # not a well-formed call: the text is the answer, as vLLM's parser gives it
        return (content.rstrip(), calls) if calls else None

    def may_start(self, text: str) -> int:
        """Where a call may begin in text still streaming (len(text) if nowhere): text before it can be sent."""
        at = text.find(self.START)
        if at >= 0:
            return at
        for keep in range(min(len(self.START) - 1, len(text)), 0, -1):  # a tag cut in half at the end
            if self.START.startswith(text[-keep:]):
                return len(text) - keep
        return len(text)


class Llama3JsonParser:
    """Llama 3.x's JSON format: the whole answer is `{"name": ..., "parameters": {...}}` (optionally after
    `<|python_tag|>`), several separated by `;`."""
    TAG = "<|python_tag|>"

    def split(self, text: str) -> tuple[str, list[ToolCall]] | None:
        body = text.strip()
        body = body[len(self.TAG):].strip() if body.startswith(self.TAG) else body
        if not body.startswith("{"):
            return None
        calls = []
        for part in body.split(";"):
            try:
                value = json.loads(part)
                args = value.get("parameters", value.get("arguments", {}))
                calls.append(ToolCall(value["name"], json.dumps(args, ensure_ascii=False)))
            except (ValueError, KeyError, TypeError, AttributeError):
                return None
        return "", calls

    def may_start(self, text: str) -> int:
        stripped = text.lstrip()
        if not stripped or stripped.startswith("{") or self.TAG.startswith(stripped[:len(self.TAG)]):
            return 0  # may be a call: hold it all until the end
        return len(text)


class HarmonyParser:
    """gpt-oss's harmony format (vLLM's `openai` parser): a call is a message to `functions.NAME`, read as the
    answer streams by its harmony splitter (router.harmony); the content is the final channel's. gpt-oss ends its
    output at a call's <|call|>; one that goes on to a second call keeps its first only under
    parallel_tool_calls false."""

    def read(self, harmony: HarmonySplit, parallel: bool = True) -> tuple[str, list[ToolCall]] | None:
        calls = [ToolCall(c.name, c.json_arguments(), c.id) for c in harmony.made_calls()]
        return (harmony.content, calls if parallel else calls[:1]) if calls else None


TOOL_CALL_PARSERS: dict[str, type[HermesParser | Llama3JsonParser | HarmonyParser]] = {
    "hermes": HermesParser, "llama3_json": Llama3JsonParser, "openai": HarmonyParser}
