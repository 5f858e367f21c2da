"""A validated OpenAI / vLLM request (router.protocol) as the router's own request: prompts, the
sampling parameters every service checks (stagemesh.core.sampling_params), and what shapes the answer.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from router.errors import bad_request
from router.protocol import ChatCompletionRequest, CompletionRequest, ChatMessage
from router.tools import ToolPlan, plan_tools
from stagemesh.core.sampling_params import (MAX_LOGPROBS, InvalidParameter, SamplingParams, StructuredOutputs,
                                            check_int)

MAX_CHOICES = 256  # prompts x n in one request
MAX_STOP_STRINGS, MAX_STOP_CHARS = 64, 4096
MAX_TEMPLATE_CHARS = 64 * 1024
ROLES = ("system", "developer", "user", "assistant", "tool")
# what a request's chat_template_kwargs may not set: the router sets these itself
RESERVED_TEMPLATE_KWARGS = {"messages", "tools", "documents", "add_generation_prompt", "continue_final_message",
                            "chat_template", "tokenize", "return_dict", "return_tensors", "conversation"}
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                   "frequency_penalty", "seed", "min_tokens")


@dataclass
class Prompt:
    text: str | None = None
    token_ids: list[int] | None = None


@dataclass
class ChatOptions:
    messages: list[dict]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    documents: list[dict] | None = None


@dataclass
class GenerateRequest:
    model: str
    chat: bool
    prompts: list[Prompt] = field(default_factory=list)  # completions; a chat renders its one prompt
    chat_options: ChatOptions | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    structured_param: str = "structured_outputs"  # the field the output constraint came in (for its 400s)
    tool_plan: ToolPlan | None = None  # chat with tools (router.tools)
    max_tokens_given: bool = False
    max_tokens_param: str = "max_tokens"  # the field max_tokens came in (max_completion_tokens, ...)
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False
    stop: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    bad_words: list[str] = field(default_factory=list)
    logprobs: bool = False
    top_logprobs: int = 0
    echo: bool = False
    echo_only: bool = False  # echo with max_tokens 0: the prompt (and its logprobs), nothing generated
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None
    truncation_side: str = "left"
    add_special_tokens: bool = True
    request_id: str | None = None
    priority: int = 0  # vLLM's request priority (router.generation.check_priority)
    # messages: list of dicts (chat) kept for the gRPC frontend, which builds requests directly
    messages: list[dict] | None = None

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.n if not self.chat else self.n


def completion_request(m: CompletionRequest, served: str) -> GenerateRequest:
    req = _common(m, served, chat=False)
    req.prompts = _prompts(m.prompt)
    if m.suffix is not None:
        raise bad_request("'suffix' is not supported by this server (as in vLLM)", "suffix")
    if m.best_of is not None and m.best_of > 1:
        raise bad_request("'best_of' is not supported (vLLM V1 does not support it either)", "best_of")
    req.echo, req.add_special_tokens = m.echo, m.add_special_tokens
    if m.logprobs is not None:
        _in_range("logprobs", m.logprobs)
        req.logprobs, req.top_logprobs = True, m.logprobs
    req.echo_only = m.echo and m.max_tokens == 0
    _finish(req, m, m.max_tokens, "max_tokens", logprobs=m.logprobs,
            prompt_logprobs=m.prompt_logprobs if m.prompt_logprobs is not None else (m.logprobs if m.echo else None))
    return _check_size(req)


def chat_request(m: ChatCompletionRequest, served: str, tool_call_parser: str | None = None) -> GenerateRequest:
    req = _common(m, served, chat=True)
    try:
        req.tool_plan = plan_tools(m.tools, m.tool_choice, m.parallel_tool_calls, tool_call_parser)
    except InvalidParameter as err:
        raise bad_request(str(err), err.param) from None
    if m.continue_final_message and m.add_generation_prompt:  # vLLM's rule: set add_generation_prompt false
        raise bad_request("'continue_final_message' and 'add_generation_prompt' cannot both be true",
                          "continue_final_message")
    req.chat_options = chat_options(m.messages, m.add_generation_prompt, m.continue_final_message, m.chat_template,
                                    m.chat_template_kwargs, m.documents)
    if req.tool_plan is not None:  # the template writes the tools into the prompt, as the model was trained to
        req.chat_options.template_kwargs["tools"] = req.tool_plan.tools
    req.messages = req.chat_options.messages
    req.echo, req.add_special_tokens = m.echo, m.add_special_tokens
    if m.top_logprobs is not None:
        _in_range("top_logprobs", m.top_logprobs)
        if m.top_logprobs and not m.logprobs:
            raise bad_request("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    req.logprobs, req.top_logprobs = m.logprobs, m.top_logprobs or 0
    param = "max_completion_tokens" if m.max_completion_tokens is not None else "max_tokens"
    _finish(req, m, m.max_completion_tokens if m.max_completion_tokens is not None else m.max_tokens, param,
            logprobs=req.top_logprobs if m.logprobs else None, prompt_logprobs=m.prompt_logprobs)
    return _check_size(req)


def chat_options(messages: list[ChatMessage], add_generation_prompt: bool, continue_final_message: bool,
                 template: str | None, kwargs: dict | None, documents: list | None) -> ChatOptions:
    if template is not None and len(template) > MAX_TEMPLATE_CHARS:
        raise bad_request(f"'chat_template' is longer than {MAX_TEMPLATE_CHARS} characters", "chat_template")
    kwargs = kwargs or {}
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(kwargs))
    if reserved:
        raise bad_request(f"'chat_template_kwargs' may not set {', '.join(reserved)}: use the request's own fields",
                          "chat_template_kwargs")
    rendered = [_message(m, i) for i, m in enumerate(messages)]
    if continue_final_message and rendered[-1]["role"] != "assistant":
        raise bad_request("'continue_final_message' needs the last message to be the assistant's",
                          "continue_final_message")
    return ChatOptions(rendered, add_generation_prompt, continue_final_message, template, dict(kwargs), documents)


def _message(m: ChatMessage, i: int) -> dict:
    where = f"messages[{i}]"
    if m.role not in ROLES:
        raise bad_request(f"'{where}.role' must be one of {', '.join(ROLES)}; got {m.role!r}", f"{where}.role")
    content = m.content
    if isinstance(content, list):  # content parts: text only, one per line as vLLM joins them
        texts = []
        for part in content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_request(f"'{where}.content' parts must be text parts (other modalities are not "
                                  "supported)", f"{where}.content")
            texts.append(part["text"])
        content = "\n".join(texts)
    if content is None:
        if not (m.role == "assistant" and m.tool_calls):
            raise bad_request(f"'{where}.content' is required (null only for an assistant message with tool_calls)",
                              f"{where}.content")
        content = ""  # templates concatenate it: an agent's tool-call turn renders as vLLM renders it
    out = {"role": m.role, "content": content}  # the developer role goes to the template as it is
    for key in ("name", "tool_call_id"):
        if getattr(m, key) is not None:
            out[key] = getattr(m, key)
    if m.tool_calls is not None:
        out["tool_calls"] = [_tool_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(m.tool_calls)]
    return out


def _tool_call(call: dict, where: str) -> dict:
    """A past tool call as chat templates take it: its arguments an object, not JSON text (as vLLM passes
    them; templates write them with tojson)."""
    fn = call.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise bad_request(f"'{where}' must be {{'id': ..., 'type': 'function', 'function': {{'name': ..., "
                          "'arguments': ...}}", where)
    arguments = fn.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            raise bad_request(f"'{where}.function.arguments' is not valid JSON", f"{where}.function.arguments") \
                from None
    return {**call, "function": {**fn, "arguments": arguments}}


def _common(m, served: str, chat: bool) -> GenerateRequest:
    if m.model is not None and m.model != served:
        from router.errors import APIError

        raise APIError(404, f"the model '{m.model}' does not exist; this server serves '{served}'", "model")
    if m.stream_options is not None and not m.stream:
        raise bad_request("'stream_options' is only allowed with 'stream': true", "stream_options")
    if m.prompt_logprobs is not None and m.stream and m.prompt_logprobs > 0:
        raise bad_request("'prompt_logprobs' are not available when streaming (as in vLLM)", "prompt_logprobs")
    if not 1 <= m.n <= MAX_CHOICES:
        raise bad_request(f"'n' must be an integer in [1, {MAX_CHOICES}]", "n")
    options = m.stream_options or None
    req = GenerateRequest(model=served, chat=chat, n=m.n, stream=m.stream,
                          include_usage=bool(options and options.include_usage),
                          continuous_usage=bool(options and options.continuous_usage_stats),
                          stop=_stop(m.stop), include_stop_str_in_output=m.include_stop_str_in_output,
                          bad_words=list(m.bad_words or []), return_token_ids=bool(m.return_token_ids),
                          return_tokens_as_token_ids=bool(m.return_tokens_as_token_ids),
                          skip_special_tokens=m.skip_special_tokens,
                          spaces_between_special_tokens=m.spaces_between_special_tokens,
                          truncation_side=m.truncation_side or "left", request_id=m.request_id,
                          priority=m.priority)
    if m.truncate_prompt_tokens is not None:
        if m.truncate_prompt_tokens < -1 or m.truncate_prompt_tokens == 0:
            raise bad_request("'truncate_prompt_tokens' must be -1 (the model's length) or an integer >= 1",
                              "truncate_prompt_tokens")
        req.truncate_prompt_tokens = m.truncate_prompt_tokens
    return req


def _finish(req: GenerateRequest, m, max_tokens: int | None, param: str, logprobs: int | None,
            prompt_logprobs: int | None) -> None:
    """The sampling parameters, checked by the rules every service shares."""
    req.max_tokens_given = max_tokens is not None and not req.echo_only
    req.max_tokens_param = param
    try:
        if req.max_tokens_given:
            check_int("max_tokens", max_tokens)
        values = {name: getattr(m, name) for name in SAMPLING_FIELDS if getattr(m, name) is not None}
        values.setdefault("temperature", 1.0)  # OpenAI's default
        bias = m.logit_bias or {}
        if any(not k.lstrip("-").isdigit() for k in bias):
            raise InvalidParameter("logit_bias", "'logit_bias' keys must be token ids (as strings of digits)")
        constraint, req.structured_param = structured(m)
        forced = req.tool_plan.constraint if req.tool_plan is not None else None
        if forced is not None:  # tool_choice required / named: the calls' JSON schema is the constraint
            if constraint is not None:
                raise InvalidParameter(req.structured_param, f"one output constraint at a time: 'tool_choice' and "
                                                             f"'{req.structured_param}' are both given")
            constraint, req.structured_param = forced, "tool_choice"
        req.sampling = SamplingParams(
            **values, max_tokens=1 if req.echo_only else (max_tokens or 16),
            stop_token_ids=tuple(m.stop_token_ids or ()), ignore_eos=m.ignore_eos, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs, logit_bias=tuple(sorted((int(k), v) for k, v in bias.items())),
            allowed_token_ids=tuple(m.allowed_token_ids or ()), structured=constraint)
    except InvalidParameter as err:
        name = {"max_tokens": param, "structured_outputs": req.structured_param}.get(err.param, err.param)
        raise bad_request(str(err).replace("'max_tokens'", f"'{name}'"), name) from None
    if m.allowed_token_ids is not None and not m.allowed_token_ids:
        raise bad_request("'allowed_token_ids' must not be empty", "allowed_token_ids")


STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
# vLLM's structured_outputs options this server does not implement: a value that asks for something is a 400
STRUCTURED_REFUSED = {"disable_fallback": "there is one backend (xgrammar), with no fallback to disable",
                      "disable_any_whitespace": "whitespace options are not supported",
                      "disable_additional_properties": "additionalProperties follows the schema as given",
                      "whitespace_pattern": "whitespace options are not supported"}


def structured(m) -> tuple[StructuredOutputs | None, str]:
    """The request's output constraint, from whichever of vLLM's spellings it uses (response_format,
    structured_outputs, guided_*), and the field it came in; two at once are a 400."""
    found: list[tuple[str, StructuredOutputs]] = []
    if m.guided_decoding_backend not in (None, "auto", "xgrammar"):
        raise InvalidParameter("guided_decoding_backend", f"'guided_decoding_backend' {m.guided_decoding_backend!r} "
                                                          "is not available: this server compiles with xgrammar")
    rf = m.response_format
    if rf is not None:
        kind = rf.get("type")
        if kind == "json_object":
            found.append(("response_format", StructuredOutputs("json_object")))
        elif kind == "json_schema":
            spec = rf.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema"), (dict, bool)):
                raise InvalidParameter("response_format", "'response_format' of type json_schema needs "
                                                          "'json_schema': {'name': ..., 'schema': {...}}")
            found.append(("response_format", StructuredOutputs("json", json.dumps(spec["schema"]))))
        elif kind == "structural_tag":  # the whole format is the tag, as vLLM passes it on
            found.append(("response_format", StructuredOutputs("structural_tag", json.dumps(rf))))
        elif kind != "text":
            raise InvalidParameter("response_format", "'response_format' type must be text, json_object, "
                                                      f"json_schema or structural_tag, got {kind!r}")
    so = m.structured_outputs
    if so is not None:
        for name, why in STRUCTURED_REFUSED.items():
            if so.get(name) not in (None, False, ""):
                raise InvalidParameter("structured_outputs", f"'structured_outputs.{name}' is not supported: {why}")
        unknown = set(so) - set(STRUCTURED_KINDS) - set(STRUCTURED_REFUSED)
        if unknown:
            raise InvalidParameter("structured_outputs", f"'structured_outputs' has no field "
                                                         f"{sorted(unknown)[0]!r}")
        given = [k for k in STRUCTURED_KINDS if so.get(k) not in (None, False)]
        if len(given) > 1:
            raise InvalidParameter("structured_outputs", "'structured_outputs' takes one of json, regex, choice, "
                                                         f"grammar, json_object and structural_tag, got "
                                                         f"{', '.join(given)}")
        if given:
            found.append(("structured_outputs", _constraint("structured_outputs", given[0], so[given[0]])))
    for kind in ("json", "regex", "choice", "grammar"):
        value = getattr(m, f"guided_{kind}")
        if value is not None:
            found.append((f"guided_{kind}", _constraint(f"guided_{kind}", kind, value)))
    if len(found) > 1:
        raise InvalidParameter(found[1][0], f"one output constraint at a time: '{found[0][0]}' and "
                                            f"'{found[1][0]}' are both given")
    return (found[0][1], found[0][0]) if found else (None, "structured_outputs")


def _constraint(field: str, kind: str, value) -> StructuredOutputs:
    try:
        return _make_constraint(field, kind, value)
    except InvalidParameter as err:  # its own rules (size, choices) name the field it came in
        raise InvalidParameter(field, str(err)) from None


def _make_constraint(field: str, kind: str, value) -> StructuredOutputs:
    if kind == "json_object":
        if value is not True:
            raise InvalidParameter(field, f"'{field}.json_object' must be true")
        return StructuredOutputs("json_object")
    if kind == "json":
        if isinstance(value, (dict, bool)):
            value = json.dumps(value)
        if not isinstance(value, str):
            raise InvalidParameter(field, f"'{field}' json must be a JSON schema (an object or its text)")
        return StructuredOutputs("json", value)
    if kind == "structural_tag" and isinstance(value, dict):
        value = json.dumps(value)
    if kind == "choice":
        if not isinstance(value, list) or not all(isinstance(c, str) for c in value):
            raise InvalidParameter(field, f"'{field}' choice must be an array of strings")
        return StructuredOutputs("choice", choices=tuple(value))
    if not isinstance(value, str):
        raise InvalidParameter(field, f"'{field}' {kind} must be a string")
    return StructuredOutputs(kind, value)


def _prompts(prompt) -> list[Prompt]:
    if isinstance(prompt, str):
        prompts = [Prompt(text=prompt)]
    elif prompt and all(isinstance(p, int) for p in prompt):
        prompts = [Prompt(token_ids=list(prompt))]
    elif prompt:
        prompts = [Prompt(text=p) if isinstance(p, str) else Prompt(token_ids=list(p)) for p in prompt]
    else:
        prompts = []
    if not prompts or any(not (p.text or p.token_ids) for p in prompts):
        raise bad_request("'prompt' must not be empty (nor any prompt in it)", "prompt")
    return prompts


def _stop(stop) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > MAX_STOP_STRINGS or sum(map(len, stops)) > MAX_STOP_CHARS:
        raise bad_request(f"'stop' takes at most {MAX_STOP_STRINGS} strings of {MAX_STOP_CHARS} characters in all",
                          "stop")
    return stops


def _in_range(name: str, value: int) -> None:
    if not 0 <= value <= MAX_LOGPROBS:
        raise bad_request(f"'{name}' must be an integer in [0, {MAX_LOGPROBS}] (vLLM's --max-logprobs "
                          f"default; -1, the whole vocabulary, is not served)", name)


def _check_size(req: GenerateRequest) -> GenerateRequest:
    if req.num_choices > MAX_CHOICES:
        raise bad_request(f"the request asks for {req.num_choices} choices (prompts x n); at most {MAX_CHOICES}",
                          "n")
    return req
