"""OpenAI request parsing and validation into plain domain types.

Every field is checked for type and range, so that a malformed request gets
a 400 naming the field rather than an error deep inside the mesh.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from router.errors import bad_request
from stagemesh.sampling_params import FLOAT_RULES, InvalidParameter, SamplingParams, check_int

# request fields that SamplingParams takes as they are (and checks by the rules every service shares)
SAMPLING_FIELDS = (*FLOAT_RULES, "top_k", "seed", "min_tokens")


@dataclass
class GenerateRequest:
    model: str
    chat: bool
    prompt_text: str | None = None  # completions with a text prompt
    prompt_ids: list[int] | None = None  # completions with token ids
    messages: list[dict] | None = None  # chat
    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_tokens_given: bool = False
    stream: bool = False
    include_usage: bool = False
    stop: list[str] = field(default_factory=list)
    logprobs: bool = False
    top_logprobs: int = 0
    echo: bool = False
    return_token_ids: bool = False
    skip_special_tokens: bool = True


def _get(body: dict, name: str, kinds, default=None, check=None, why: str = ""):
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in (kinds if isinstance(kinds, tuple) else (kinds,)):
        raise bad_request(f"'{name}' must be {why or _kind_name(kinds)}, got a boolean", name)
    if not isinstance(value, kinds):
        raise bad_request(f"'{name}' must be {why or _kind_name(kinds)}, got {type(value).__name__}", name)
    if check is not None and not check(value):
        raise bad_request(f"'{name}' must be {why}, got {value!r}", name)
    return value


def _kind_name(kinds) -> str:
    names = {int: "an integer", float: "a number", str: "a string", bool: "a boolean", list: "an array",
             dict: "an object"}
    kinds = kinds if isinstance(kinds, tuple) else (kinds,)
    return " or ".join(names.get(k, k.__name__) for k in kinds)


def parse_request(body: Any, chat: bool) -> GenerateRequest:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    model = _get(body, "model", str, why="a string")
    if model is None:
        raise bad_request("'model' is required", "model")
    req = GenerateRequest(model=model, chat=chat)
    if chat:
        req.messages = _messages(body)
    else:
        _prompt(body, req)
    _get(body, "n", int, 1, lambda v: v == 1, "1 (only one choice per request is supported)")
    req.stream = _get(body, "stream", bool, False)
    options = _get(body, "stream_options", dict, {})
    if options and not req.stream:
        raise bad_request("'stream_options' is only allowed with 'stream': true", "stream_options")
    req.include_usage = bool(options.get("include_usage", False))
    req.stop = _stop(body)
    req.echo = _get(body, "echo", bool, False)
    req.return_token_ids = _get(body, "return_token_ids", bool, False)
    req.skip_special_tokens = _get(body, "skip_special_tokens", bool, True)
    logprobs = _logprobs(body, chat, req)
    param = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = body.get(param)
    req.max_tokens_given = max_tokens is not None
    values = {name: body[name] for name in SAMPLING_FIELDS if body.get(name) is not None}
    values.setdefault("temperature", 1.0)  # OpenAI's default
    try:
        if req.max_tokens_given:
            check_int("max_tokens", max_tokens)
        req.sampling = SamplingParams(**values, max_tokens=max_tokens or 16,
                                      stop_token_ids=tuple(_int_list(body, "stop_token_ids")),
                                      ignore_eos=_get(body, "ignore_eos", bool, False), logprobs=logprobs)
    except InvalidParameter as err:
        name = param if err.param == "max_tokens" else err.param
        raise bad_request(str(err).replace("'max_tokens'", f"'{name}'"), name) from None
    return req


def _messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if messages is None:
        raise bad_request("'messages' is required", "messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty array", "messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad_request(f"'{where}' must be an object", where)
        role = m.get("role")
        if role not in ("system", "user", "assistant", "developer", "tool"):
            raise bad_request(f"'{where}.role' must be one of system, user, assistant, developer, tool; got {role!r}",
                              f"{where}.role")
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise bad_request(f"'{where}.content' parts must be text parts", f"{where}.content")
                texts.append(part["text"])
            content = "".join(texts)
        if not isinstance(content, str):
            raise bad_request(f"'{where}.content' must be a string or an array of text parts", f"{where}.content")
        out.append({"role": "system" if role == "developer" else role, "content": content})
    return out


def _prompt(body: dict, req: GenerateRequest) -> None:
    prompt = body.get("prompt")
    if prompt is None:
        raise bad_request("'prompt' is required", "prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise bad_request("'prompt' must not be empty", "prompt")
        req.prompt_text = prompt
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        req.prompt_ids = prompt
    elif isinstance(prompt, list) and len(prompt) > 1:
        raise bad_request("'prompt' must be one string or one list of token ids (batches are not supported)", "prompt")
    else:
        raise bad_request("'prompt' must be a non-empty string or a non-empty list of token ids", "prompt")


def _stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop) or len(stop) > 4:
        raise bad_request("'stop' must be a string or an array of at most 4 strings", "stop")
    return stop


def _int_list(body: dict, name: str) -> list[int]:
    value = body.get(name) or []
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise bad_request(f"'{name}' must be an array of integers", name)
    return value


def _logprobs(body: dict, chat: bool, req: GenerateRequest) -> int | None:
    if chat:
        req.logprobs = _get(body, "logprobs", bool, False)
        req.top_logprobs = _get(body, "top_logprobs", int, 0, lambda v: 0 <= v <= 20, "an integer in [0, 20]")
        if req.top_logprobs and not req.logprobs:
            raise bad_request("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        return req.top_logprobs if req.logprobs else None
    value = _get(body, "logprobs", int, None, lambda v: 0 <= v <= 20, "an integer in [0, 20]")
    req.logprobs, req.top_logprobs = value is not None, value or 0
    return value
