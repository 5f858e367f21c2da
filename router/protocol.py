"""The OpenAI / vLLM request schema, declared once (pydantic, strict types): the gateway validates
every body with it and /openapi.json describes it.

Every field vLLM's server takes is here: it works as vLLM's does (router.openai_request reads it into the
mesh's domain types), or a value other than its default is refused with a 400 that names it
(REFUSED). A field nobody defines (not OpenAI's, not vLLM's) is ignored with one warning, as vLLM does.
"""
from __future__ import annotations

import logging
from typing import Any, Literal, TypeVar, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic_core import ErrorDetails

from router.errors import bad_request

log = logging.getLogger("stagemesh.router")
TokenIds = list[int]


class Strict(BaseModel):
    # strict: "10" is not an integer and 1 is not a boolean, as OpenAI's own validation has it
    model_config = ConfigDict(extra="allow", strict=True)


class StreamOptions(Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Sampling(Strict):
    """What completions and chat completions share."""
    model: str | None = None
    n: int = 1
    best_of: int | None = None  # vLLM's: at least n; more than 1 is not served (vLLM V1 serves none)
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    max_tokens: int | None = None
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None
    truncation_side: Literal["left", "right"] | None = None
    return_tokens_as_token_ids: bool | None = None
    return_token_ids: bool | None = None
    request_id: str | None = None
    priority: int = 0  # vLLM's: lower first, with --scheduling-policy priority on the replicas
    # vLLM's: its prefix-cache blocks are shared only with requests of the same salt (multi-tenant isolation)
    cache_salt: str | None = None
    user: str | None = None  # OpenAI's end-user id: for the caller's own records, as in vLLM
    # constrained decoding (router.openai_request.structured): one of these at a time
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: Union[str, dict[str, Any], None] = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None


    @field_validator("cache_salt")
    @classmethod
    def _salt_not_empty(cls, salt: str | None) -> str | None:
        if salt is not None and not salt:  # (vLLM's rule and words)
            raise ValueError("Parameter 'cache_salt' must be a non-empty string if provided.")
        return salt


class CompletionRequest(_Sampling):
    prompt: Union[str, list[str], TokenIds, list[TokenIds]]
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    add_special_tokens: bool = True


class ChatMessage(Strict):
    role: str
    content: Union[str, list[dict[str, Any]], None] = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    # an earlier answer's thinking (--reasoning-parser), given back: it reaches the chat template, as vLLM gives it
    reasoning: str | None = None
    reasoning_content: str | None = None


REQUEST_TEMPLATE = ("A Jinja chat template of the request's own, instead of the model's: refused (400) unless the "
                    "router runs with --trust-request-chat-template; then rendered in a worker process, stopped "
                    "past --chat-template-timeout or past the longest prompt the model can take (400)")


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = None
    max_completion_tokens: int | None = None
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    documents: list[dict[str, str]] | None = None
    chat_template: str | None = Field(None, description=REQUEST_TEMPLATE)
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Union[str, dict[str, Any], None] = None
    parallel_tool_calls: bool | None = None
    include_reasoning: bool = True  # vLLM's: false drops the reasoning (--reasoning-parser) from the answer
    reasoning_effort: Literal["none", "low", "medium", "high"] | None = None  # to the chat template (gpt-oss's)


class TokenizeRequest(Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = Field(None, description=REQUEST_TEMPLATE)
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, str]] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(Strict):
    model: str | None = None
    tokens: list[int]


# vLLM's fields this server does not implement: any value but the default (None, False, 0, 1) gets a 400
# naming the field; the reason says what to do instead
_MULTIMODAL = "multimodal inputs are not supported"
_TOOLS = "functions are not supported (tool calling is not supported yet)"
_STORED = "stored completions are not supported"
REFUSED: dict[str, str] = {
    "use_beam_search": "beam search is not supported",
    "length_penalty": "length_penalty only applies to beam search, which is not supported",
    "watermarking": "watermarking is not supported",
    "logprob_token_ids": "logprob_token_ids is not supported; use logprobs / top_logprobs",
    "prompt_embeds": "prompt embeddings are not supported; send text or token ids",
    "kv_transfer_params": "disaggregated prefill is not supported",
    "ec_transfer_params": "disaggregated encoding is not supported",
    "vllm_xargs": "vllm_xargs (extensions) are not supported",
    "repetition_detection": "repetition_detection is not supported",
    "thinking_token_budget": "thinking_token_budget is not supported",
    "stream_interval": "stream_interval is not supported: every token is streamed as it comes",
    "return_token_offsets": "return_token_offsets is only for the render endpoints, which this server lacks",
    "session_id": "session_id is not supported",
    "routed_experts_prompt_start": "returning routed experts is not supported",
    "media_io_kwargs": _MULTIMODAL, "mm_processor_kwargs": _MULTIMODAL,
    "audio": "audio output is not supported", "modalities": "only text output is supported",
    "prediction": "predicted outputs are not supported", "web_search_options": "web search is not supported",
    "function_call": _TOOLS, "functions": _TOOLS,
    "store": _STORED, "metadata": _STORED,
    "service_tier": "service tiers are not supported", "verbosity": "verbosity is not supported",
}
# the value each refused field may still have: it asks for nothing (the others: None, false, empty)
NEUTRAL = {"length_penalty": (1, 1.0), "routed_experts_prompt_start": (0,),
           "service_tier": ("auto", "default"), "modalities": (["text"],)}


def _asks_for_something(name: str, value, neutral: dict) -> bool:
    if value is None or value is False or value == [] or value == {}:
        return False
    return not any(type(value) is type(v) and value == v for v in neutral.get(name, ()))
# fields the OpenAI or vLLM schemas define that change nothing here (so no warning when they come)
KNOWN_INERT = {"mm_processor_kwargs", "return_prompt_text"}


M = TypeVar("M", bound=BaseModel)


def validate(model: type[M], body: Any, refused: dict[str, str] = REFUSED,
             neutral: dict[str, tuple] = NEUTRAL) -> M:
    """The body as `model`, or a 400 that names the first field that is wrong (or that asks for something this
    server refuses: `refused` names them, with why; `neutral`, the values of theirs that ask for nothing)."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    for name, why in refused.items():
        if name in body and _asks_for_something(name, body[name], neutral):
            raise bad_request(f"'{name}' is not supported by this server: {why}", name)
    try:
        parsed = model.model_validate(body)
    except ValidationError as err:
        raise bad_request(*_describe(err)) from None
    unknown = sorted(set(parsed.model_extra or ()) - set(refused) - KNOWN_INERT)
    if unknown:
        log.warning("ignoring unknown request field(s) %s", ", ".join(unknown[:8]))
    return parsed


def checked_field(model: type[BaseModel], name: str, value: Any) -> Any:
    """One field's value as `model`'s schema reads it, or its 400 in the same words as a whole body's (the gRPC
    frontend's fields that come as JSON text: chat_template_kwargs, documents)."""
    try:
        instance = model.model_construct()
        model.__pydantic_validator__.validate_assignment(instance, name, value)
    except ValidationError as err:
        raise bad_request(*_describe(err)) from None
    return getattr(instance, name)


# what a field must be, where its type is a union or a list (pydantic would name only one branch or item)
FIELD_TEXT = {
    "prompt": "a string, an array of strings, an array of token ids, or an array of those",
    "stop": "a string or an array of strings", "messages": "a non-empty array of messages",
    "content": "a string, null, or an array of text parts", "tool_choice": "a string or an object",
    "stop_token_ids": "an array of integers", "allowed_token_ids": "an array of integers",
    "tokens": "an array of integers", "bad_words": "an array of strings", "logit_bias": "an object of token ids "
                                                                                          "to numbers",
    "guided_json": "a JSON schema (an object or its text)", "guided_choice": "an array of strings",
}
TYPE_TEXT = {"string_type": "a string", "int_type": "an integer", "float_type": "a number", "bool_type": "a boolean",
             "list_type": "an array", "dict_type": "an object", "model_type": "an object", "model_attributes_type":
             "an object", "too_short": "not empty", "int_from_float": "an integer", "literal_error": "one of"}


def _describe(err: ValidationError) -> tuple[str, str | None]:
    first = err.errors()[0]
    # union branches appear in the path by their type name ('str', 'list[int]'): leave them out
    loc = [p for p in first["loc"] if isinstance(p, int) or p.isidentifier() and p not in TYPE_NAMES]
    names = [p for p in loc if isinstance(p, str)]
    field = names[-1] if names else None
    if first["type"] == "missing":
        return f"'{_path(loc)}' is required", _path(loc)
    if field in FIELD_TEXT and (loc[-1] == field or isinstance(loc[-1], int) and field != "messages"):
        where = _path(loc[:loc.index(field) + 1] if field in loc else loc)
        return f"'{where}' must be {FIELD_TEXT[field]}, got {_kind(first)}", where
    where = _path(loc)
    what = TYPE_TEXT.get(first["type"])
    if what == "one of":
        return f"'{where}': {first['msg']}", where
    if what is not None:
        return f"'{where}' must be {what}, got {_kind(first)}", where
    return (f"'{where}': {first['msg']}" if where else first["msg"]), where


TYPE_NAMES = {"str", "int", "float", "bool", "dict", "list"}


def _path(loc: list) -> str | None:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else part)
    return out or None


def _kind(error: ErrorDetails) -> str:
    value = error.get("input")
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
            dict: "an object", type(None): "null"}.get(type(value), type(value).__name__)
