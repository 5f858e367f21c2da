"""The HTTP door: a validated OpenAI / vLLM body (router.protocol) read into the request builder
(router.request_builder), which checks every value. What is here is OpenAI's and vLLM's spelling only: the
prompt's shapes, chat's logprobs flag, OpenAI's sampling defaults, logit_bias's keys, and the fields a
structured-output constraint may come in."""
from __future__ import annotations

import json
from dataclasses import replace

from router.errors import bad_request
from router.config import RouterConfig
from router.protocol import ChatCompletionRequest, CompletionRequest
from router.request import GenerateRequest, Prompt
from router.request_builder import RequestBuilder
from stagemesh.core.sampling_params import SCALAR_FIELDS, InvalidParameter, StructuredOutputs

# SamplingParams' numbers and switches that a body names alike pass straight in (the request builder checks
# them); max_tokens and the logprobs are read apart (their defaults and names differ by endpoint)
# the value of a sampling parameter a body and the model's generation config both leave unset (OpenAI's
# temperature; vLLM's other neutral values are SamplingParams' own)
OPENAI_NEUTRAL = {"temperature": 1.0}
SAMPLING_FIELDS = tuple(name for name in SCALAR_FIELDS if name in CompletionRequest.model_fields
                        and name in ChatCompletionRequest.model_fields
                        and name not in ("max_tokens", "logprobs", "prompt_logprobs"))


def completion_request(m: CompletionRequest, config: RouterConfig) -> GenerateRequest:
    b = _common(m, config, chat=False)
    b.prompts(_prompts(m.prompt))
    if m.suffix is not None:
        raise bad_request("'suffix' is not supported by this server (as in vLLM)", "suffix")
    b.req.echo, b.req.add_special_tokens = m.echo, m.add_special_tokens
    logprobs = b.logprobs("logprobs", m.logprobs)
    b.max_tokens(m.max_tokens, "max_tokens", echo_only=m.echo and m.max_tokens == 0)
    _sampling(b, m, logprobs, m.prompt_logprobs if m.prompt_logprobs is not None else (logprobs if m.echo else None))
    return b.build()


def chat_request(m: ChatCompletionRequest, config: RouterConfig) -> GenerateRequest:
    b = _common(m, config, chat=True)
    b.tools(m.tools, m.tool_choice, m.parallel_tool_calls, config.tool_call_parser)
    b.conversation(m.messages, m.add_generation_prompt, m.continue_final_message, m.chat_template,
                   m.chat_template_kwargs, m.documents)
    b.reasoning_effort(m.reasoning_effort)
    b.reasoning(config.reasoning_parser, config.template_thinks, m.include_reasoning)
    b.req.echo, b.req.add_special_tokens = m.echo, m.add_special_tokens
    top = b.logprobs("top_logprobs", m.top_logprobs)
    if top and not m.logprobs:
        raise bad_request("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    given = m.max_completion_tokens is not None
    b.max_tokens(m.max_completion_tokens if given else m.max_tokens, "max_completion_tokens" if given else "max_tokens")
    _sampling(b, m, (top or 0) if m.logprobs else None, m.prompt_logprobs)
    return b.build()


def _common(m, config: RouterConfig, chat: bool) -> RequestBuilder:
    b = RequestBuilder(config.served_model_name, m.model, chat, config.adapter_names, config.sampling_defaults)
    b.streaming(m.stream, m.stream_options or None, m.prompt_logprobs)
    b.choices(m.n, m.best_of)
    b.stop(m.stop, m.include_stop_str_in_output)
    b.priority(m.priority)
    b.per_request(cache_salt=m.cache_salt)
    req = b.req
    req.bad_words, req.request_id = list(m.bad_words or []), m.request_id
    req.return_token_ids, req.return_tokens_as_token_ids = bool(m.return_token_ids), bool(m.return_tokens_as_token_ids)
    req.skip_special_tokens, req.spaces_between_special_tokens = m.skip_special_tokens, m.spaces_between_special_tokens
    b.truncation(m.truncate_prompt_tokens, m.truncation_side)
    return b


def _sampling(b: RequestBuilder, m, logprobs: int | None, prompt_logprobs: int | None) -> None:
    values = {name: getattr(m, name) for name in SAMPLING_FIELDS if getattr(m, name) is not None}
    bias = m.logit_bias or {}
    try:
        if any(not k.lstrip("-").isdigit() for k in bias):
            raise InvalidParameter("logit_bias", "'logit_bias' keys must be token ids (as strings of digits)")
        constraint, where = structured(m)
    except InvalidParameter as err:
        raise bad_request(str(err), err.param) from None
    b.sampling({**values, "stop_token_ids": tuple(m.stop_token_ids or ()), "logprobs": logprobs,
                "prompt_logprobs": prompt_logprobs,
                "logit_bias": tuple(sorted((int(k), v) for k, v in bias.items())),
                "allowed_token_ids": tuple(m.allowed_token_ids or ())}, constraint, where, OPENAI_NEUTRAL)
    if m.allowed_token_ids is not None and not m.allowed_token_ids:
        raise bad_request("'allowed_token_ids' must not be empty", "allowed_token_ids")


STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
# vLLM's structured_outputs options this server does not implement: a value that asks for something is a 400
STRUCTURED_REFUSED = {"disable_fallback": "there is one backend (xgrammar), with no fallback to disable",
                      "disable_additional_properties": "additionalProperties follows the schema as given",
                      "whitespace_pattern": "xgrammar takes no whitespace pattern: use disable_any_whitespace"}
BACKEND_OPTION = "disable-any-whitespace"  # vLLM's guided_decoding_backend "xgrammar:disable-any-whitespace"


def structured(m) -> tuple[StructuredOutputs | None, str]:
    """The request's output constraint, from whichever of vLLM's spellings it uses (response_format,
    structured_outputs, guided_*), and the field it came in; two at once are a 400."""
    found: list[tuple[str, StructuredOutputs]] = []
    compact = _backend_compact(m.guided_decoding_backend)
    if m.response_format is not None:
        found += _response_format(m.response_format)
    so = m.structured_outputs
    if so is not None:
        for name, why in STRUCTURED_REFUSED.items():
            if so.get(name) not in (None, False, ""):
                raise InvalidParameter("structured_outputs", f"'structured_outputs.{name}' is not supported: {why}")
        unknown = set(so) - set(STRUCTURED_KINDS) - set(STRUCTURED_REFUSED) - {"disable_any_whitespace"}
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
        if so.get("disable_any_whitespace") is not None:
            if not isinstance(so["disable_any_whitespace"], bool):
                raise InvalidParameter("structured_outputs", "'structured_outputs.disable_any_whitespace' must be "
                                                             "true or false")
            compact = so["disable_any_whitespace"]
    for kind in ("json", "regex", "choice", "grammar"):
        value = getattr(m, f"guided_{kind}")
        if value is not None:
            found.append((f"guided_{kind}", _constraint(f"guided_{kind}", kind, value)))
    if len(found) > 1:
        raise InvalidParameter(found[1][0], f"one output constraint at a time: '{found[0][0]}' and "
                                            f"'{found[1][0]}' are both given")
    if not found:
        return None, "structured_outputs"
    where, constraint = found[0]
    if compact is not None and constraint.kind in ("json", "json_object"):  # else the server's default
        constraint = replace(constraint, any_whitespace=not compact)
    return constraint, where


def _backend_compact(backend: str | None) -> bool | None:
    """vLLM's guided_decoding_backend: "auto" or "xgrammar", with its option "disable-any-whitespace" after
    a colon (True: compact JSON; None: not said)."""
    if backend is None:
        return None
    name, _, options = backend.partition(":")
    unknown = [o for o in options.split(",") if o and o != BACKEND_OPTION]
    if name not in ("auto", "xgrammar") or unknown:
        raise InvalidParameter("guided_decoding_backend", f"'guided_decoding_backend' {backend!r} is not available: "
                                                          "this server compiles with xgrammar (auto or xgrammar, "
                                                          f"optionally ':{BACKEND_OPTION}')")
    return True if BACKEND_OPTION in options.split(",") else None


def _response_format(rf: dict) -> list[tuple[str, StructuredOutputs]]:
    kind = rf.get("type")
    if kind == "json_object":
        return [("response_format", StructuredOutputs("json_object"))]
    if kind == "json_schema":
        spec = rf.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), (dict, bool)):
            raise InvalidParameter("response_format", "'response_format' of type json_schema needs "
                                                      "'json_schema': {'name': ..., 'schema': {...}}")
        return [("response_format", StructuredOutputs("json", json.dumps(spec["schema"])))]
    if kind == "structural_tag":  # the whole format is the tag, as vLLM passes it on
        return [("response_format", StructuredOutputs("structural_tag", json.dumps(rf)))]
    if kind != "text":
        raise InvalidParameter("response_format", "'response_format' type must be text, json_object, "
                                                  f"json_schema or structural_tag, got {kind!r}")
    return []


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
        return [Prompt(text=prompt)]
    if prompt and all(isinstance(p, int) for p in prompt):
        return [Prompt(token_ids=list(prompt))]
    return [Prompt(text=p) if isinstance(p, str) else Prompt(token_ids=list(p)) for p in prompt or []]
