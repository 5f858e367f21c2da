"""A Responses API request (POST /v1/responses) as the chat completion it asks for: the instructions, the
stored conversation (previous_response_id) and the input items become chat messages, flat function tools
become chat tools, text.format the output constraint, include's logprobs chat's logprobs. The chat path
(router.openai_request, router.request_builder) then checks and builds it, and its errors are named in this
request's own fields.

What this server does not build is refused by name: built-in tools (web search, file search, code
interpreter, MCP, ...), background mode, conversations, prompt templates, a chat template of its own,
reasoning options, truncation "auto", item references and reasoning items in the input.
"""
from __future__ import annotations

from typing import Any, Union

from router.errors import APIError, bad_request
from router.protocol import Strict

_NONE = "this server does not build it"
REFUSED: dict[str, str] = {
    "background": "background mode is not supported: send the request and wait for it (or stream it)",
    "background_options": "background mode is not supported",
    "conversation": "conversations are not supported: use previous_response_id",
    "prompt": "prompt templates are not supported (as in vLLM)",
    "max_tool_calls": "it limits built-in tool calls, and this server runs no built-in tool",
    "prompt_cache_key": "the prefix cache needs no key here: repeated prefixes are found by their tokens",
    "prompt_cache_options": _NONE, "prompt_cache_retention": _NONE, "context_management": _NONE,
    "stream_options": "stream obfuscation is not supported", "access_programs": _NONE, "image": _NONE,
    "moderation": _NONE, "previous_response": "send previous_response_id (the response store is on)",
    "previous_input_messages": "send previous_response_id", "enable_response_messages": _NONE,
    "vllm_xargs": "vllm_xargs (extensions) are not supported",
    "truncation": "only 'disabled' is supported: a conversation past the context length is a 400",
    "service_tier": "service tiers are not supported",
    "chat_template": "the Responses API renders the model's own chat template (chat completions take a request's "
                     "own with the router's --trust-request-chat-template)",
}
NEUTRAL = {"truncation": ("disabled",), "service_tier": ("auto", "default")}
TEXT_PARTS = ("input_text", "output_text", "text")
INCLUDE_LOGPROBS = "message.output_text.logprobs"


class ResponsesRequest(Strict):
    model: str | None = None
    input: Union[str, list[dict[str, Any]]]
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Union[str, dict[str, Any], None] = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    include: list[str] | None = None
    top_logprobs: int | None = None
    reasoning: dict[str, Any] | None = None
    stream: bool = False
    store: bool = True
    metadata: dict[str, str] | None = None
    user: str | None = None  # for the caller's records, as OpenAI's
    safety_identifier: str | None = None  # (the same)
    request_id: str | None = None
    priority: int = 0
    cache_salt: str | None = None  # vLLM's (chat completions' rule: not empty)


def chat_body(m: ResponsesRequest, history: list[dict]) -> tuple[dict, list[str]]:
    """The chat completions body `m` asks for (after `history`, the stored conversation it continues), and
    where each of its messages came from, for errors."""
    _refuse_options(m)
    messages, origins = [], []
    if m.instructions:  # the instructions of this request only: they do not carry over (OpenAI's rule)
        messages.append({"role": "system", "content": m.instructions})
        origins.append("instructions")
    messages += [dict(message) for message in history]  # (a turn may grow: the stored one must not)
    origins += ["previous_response_id"] * len(history)
    items = [{"role": "user", "content": m.input}] if isinstance(m.input, str) else m.input
    for i, item in enumerate(items):
        _add_item(messages, origins, item, "input" if isinstance(m.input, str) else f"input[{i}]")
    partial = _partial(items[-1]) if items else False
    body = {"model": m.model, "messages": messages, "max_tokens": m.max_output_tokens,
            "add_generation_prompt": not partial, "continue_final_message": partial,
            "tools": [_chat_tool(t, f"tools[{i}]") for i, t in enumerate(m.tools)] if m.tools else None,
            "tool_choice": _chat_tool_choice(m.tool_choice), "parallel_tool_calls": m.parallel_tool_calls,
            "response_format": _response_format(m.text), **_logprobs(m),
            "reasoning_effort": (m.reasoning or {}).get("effort")}
    for name in ("temperature", "top_p", "top_k", "seed", "repetition_penalty", "logit_bias", "stop", "ignore_eos",
                 "skip_special_tokens", "include_stop_str_in_output", "structured_outputs", "user", "request_id",
                 "priority", "cache_salt"):
        body[name] = getattr(m, name)
    return {k: v for k, v in body.items() if v is not None}, origins


def _partial(item) -> bool:
    """An assistant message left in_progress or incomplete, last: the answer continues it (vLLM's rule)."""
    return isinstance(item, dict) and item.get("type", "message") == "message" and item.get("role") == "assistant" \
        and item.get("status") in ("in_progress", "incomplete")


def _refuse_options(m: ResponsesRequest) -> None:
    if m.reasoning and any(v is not None for k, v in m.reasoning.items() if k != "effort"):
        raise bad_request("'reasoning' takes 'effort' only here (given to the chat template as reasoning_effort): "
                          "no summary is made of the model's reasoning", "reasoning")
    if m.text and m.text.get("verbosity") is not None:
        raise bad_request("'text.verbosity' is not supported by this server", "text.verbosity")
    if m.previous_response_id is not None and not m.previous_response_id:
        raise bad_request("'previous_response_id' must not be empty", "previous_response_id")
    metadata = m.metadata or {}
    if len(metadata) > 16 or any(len(k) > 64 or len(v) > 512 for k, v in metadata.items()):
        raise bad_request("'metadata' holds at most 16 pairs, keys of 64 characters and values of 512 at most "
                          "(OpenAI's limits)", "metadata")


def _add_item(messages: list[dict], origins: list[str], item, where: str) -> None:
    """One input item as chat messages: a message, a function call (merged into the assistant's turn before
    it, as vLLM merges them) or a function call's output (a tool message)."""
    if not isinstance(item, dict):
        raise bad_request(f"'{where}' must be an object", where)
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in ("user", "system", "developer", "assistant"):
            raise bad_request(f"'{where}.role' must be user, system, developer or assistant; got {role!r}",
                              f"{where}.role")
        message = {"role": role, "content": _text(item.get("content"), f"{where}.content")}
    elif kind == "function_call":
        message = _call_turn(item, where)
        if messages and messages[-1]["role"] == "assistant":  # the same turn: its text, its other calls
            last = messages[-1]
            last["tool_calls"] = [*(last.get("tool_calls") or ()), *message["tool_calls"]]
            return
    elif kind == "function_call_output":
        message = {"role": "tool", "tool_call_id": _string(item, "call_id", where),
                   "content": _text(item.get("output"), f"{where}.output")}
    else:
        raise bad_request(f"'{where}.type' {kind!r} is not supported by this server: input items are messages, "
                          "function_call and function_call_output", f"{where}.type")
    messages.append(message)
    origins.append(where)


def _call_turn(item: dict, where: str) -> dict:
    arguments = item.get("arguments", "")
    if not isinstance(arguments, str):
        raise bad_request(f"'{where}.arguments' must be a string (JSON text)", f"{where}.arguments")
    call = {"id": _string(item, "call_id", where), "type": "function",
            "function": {"name": _string(item, "name", where), "arguments": arguments}}
    return {"role": "assistant", "content": None, "tool_calls": [call]}


def _string(item: dict, key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not value:
        raise bad_request(f"'{where}.{key}' must be a non-empty string", f"{where}.{key}")
    return value


def _text(content, where: str) -> str:
    """A message's content or a call's output: a string, or text parts joined by newlines (as chat's)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"'{where}' must be a string or an array of text parts", where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        text = part.get("text", part.get("refusal")) if isinstance(part, dict) else None
        if kind not in (*TEXT_PARTS, "refusal") or not isinstance(text, str):
            raise bad_request(f"'{where}[{j}]' must be a text part (input_text, output_text); other modalities "
                              "are not supported", f"{where}[{j}]")
        texts.append(text)
    return "\n".join(texts)


def _chat_tool(tool: dict, where: str) -> dict:
    """A Responses function tool ({type, name, description, parameters, strict}) as a chat tool."""
    kind = tool.get("type") if isinstance(tool, dict) else None
    if kind != "function":
        raise bad_request(f"'{where}.type' {kind!r} is not supported by this server: only function tools (it runs "
                          "no built-in tool: web search, file search, code interpreter, MCP, ...)", f"{where}.type")
    return {"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}}


def _chat_tool_choice(choice):
    if choice is None or isinstance(choice, str):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and "function" not in choice:
        return {"type": "function", "function": {"name": choice.get("name")}}
    kind = choice.get("type") if isinstance(choice, dict) else None
    raise bad_request(f"'tool_choice' of type {kind!r} is not supported by this server: \"none\", \"auto\", "
                      "\"required\" or {'type': 'function', 'name': ...}", "tool_choice")


def _response_format(text: dict | None) -> dict | None:
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise bad_request("'text.format' must be an object", "text.format")
    if fmt.get("type") == "json_schema":
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": spec}
    return fmt  # text, json_object (anything else: chat's 400, named text.format)


def _logprobs(m: ResponsesRequest) -> dict:
    other = [i for i in m.include or () if i != INCLUDE_LOGPROBS]
    if other:
        raise bad_request(f"'include' {other[0]!r} is not supported by this server: only {INCLUDE_LOGPROBS!r}",
                          "include")
    wanted = INCLUDE_LOGPROBS in (m.include or ())
    if m.top_logprobs and not wanted:
        raise bad_request(f"'top_logprobs' needs 'include': ['{INCLUDE_LOGPROBS}']", "top_logprobs")
    return {"logprobs": True, "top_logprobs": m.top_logprobs or 0} if wanted else {}


# chat's field names -> this request's, for errors found on the chat path
RENAMED = {"max_tokens": "max_output_tokens", "response_format": "text.format", "logprobs": "include",
           "messages": "input", "reasoning_effort": "reasoning.effort"}


def renamed(err: APIError, origins: list[str]) -> APIError:
    """An error of the chat path, naming the field of this request it came from."""
    param = err.param
    if param is None:
        return err
    if param.startswith("messages["):
        index, _, rest = param[len("messages["):].partition("]")
        where = origins[int(index)] if index.isdigit() and int(index) < len(origins) else "input"
        new = where + rest
    else:
        new = RENAMED.get(param, param)
    message = err.message.replace(f"'{param}'", f"'{new}'").replace(f"{param}=", f"{new}=")
    return APIError(err.status, message, new, err.retry_after)
