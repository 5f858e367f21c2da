"""The one builder of the router's request (router.request.GenerateRequest) for both doors: the HTTP gateway
(router.openai_request reads an OpenAI / vLLM body into it) and the gRPC frontend (router.frontend reads a
Frontend request into it). Every rule on a request's values is checked here, once, in the same words
whichever door it came in; a door keeps only its own spellings (OpenAI's structured-output fields, chat's
logprobs flag, ...). router.admission then runs what was built, the same way for both."""
from __future__ import annotations

import json
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

from router import reasoning
from router.errors import APIError, bad_request
from router.generation_config import SamplingDefaults
from router.protocol import ChatMessage, StreamOptions
from router.request import ChatOptions, GenerateRequest, Prompt
from router.tools import plan_tools
from stagemesh.core.engine_request import EngineRequest
from stagemesh.core.sampling_params import INT32_MAX, MAX_LOGPROBS, InvalidParameter, SamplingParams, \
    StructuredOutputs, check_int

MAX_CHOICES = 256  # prompts x n in one request
MAX_STOP_STRINGS, MAX_STOP_CHARS = 64, 4096
MAX_TEMPLATE_CHARS = 64 * 1024
ROLES = ("system", "developer", "user", "assistant", "tool")
# what a request's chat_template_kwargs may not set: the router sets these itself
# vLLM starts a constraint where the reasoning ends (its reasoning parser tells the engine where); here the
# stages would apply it from the first token, so a model that starts in thinking could not think
REASONING_CONSTRAINT = ("'{}' is not supported with --reasoning-parser while the model thinks (its chat template "
                        "starts the answer in a <think> block): an output constraint applies after the reasoning in "
                        "vLLM, which is not built here yet (a Qwen3 request with chat_template_kwargs "
                        "{{\"enable_thinking\": false}} may have one)")
# vLLM serves gpt-oss's forced calls through its harmony renderer; here a constraint would apply from the answer's
# first token, where gpt-oss writes its analysis channel
HARMONY_FORCED = ("tool_choice \"required\" and a named function are not supported under gpt-oss's harmony format "
                  "(--reasoning-parser openai_gptoss) yet: the call's JSON constraint would apply from the answer's "
                  "first token, where the model writes its analysis; use tool_choice \"auto\" (--tool-call-parser "
                  "openai reads the calls) or \"none\"")
RESERVED_TEMPLATE_KWARGS = {"messages", "tools", "documents", "add_generation_prompt", "continue_final_message",
                            "chat_template", "tokenize", "return_dict", "return_tensors", "conversation"}


def check_model(model: str | None, served: str, adapters: tuple[str, ...] = ()) -> str:
    """The LoRA adapter a request's model names ("": the served model itself); vLLM's 404 for another."""
    if model is None or model == served:
        return ""
    if model in adapters:
        return model
    names = "', '".join((served, *adapters))
    raise APIError(404, f"the model '{model[:200]}' does not exist; this server serves '{names}'", "model")


class RequestBuilder:
    """A request built step by step, each step checking what it is given. A door calls the steps its request
    has fields for, in the order they are written here (so that the first error named is the same whichever
    door), then build()."""

    def __init__(self, served: str, model: str | None, chat: bool, adapters: tuple[str, ...] = (),
                 defaults: SamplingDefaults | None = None, stream_interval: int = 1):
        """adapters: the LoRA adapters a model name may pick (--lora-modules); defaults: the model's generation
        config, for the sampling parameters the request leaves unset; stream_interval: the router's."""
        lora_name = check_model(model, served, adapters)
        self.req = GenerateRequest(model=lora_name or served, chat=chat,
                                   engine=EngineRequest("", (), lora_name=lora_name), stream_interval=stream_interval)
        self.defaults = defaults or SamplingDefaults()
        self._max_tokens = INT32_MAX  # SamplingParams' max_tokens until max_tokens() says otherwise

    def streaming(self, stream: bool, options: StreamOptions | None = None, prompt_logprobs: int | None = None
                  ) -> None:
        if options is not None and not stream:
            raise bad_request("'stream_options' is only allowed with 'stream': true", "stream_options")
        if prompt_logprobs is not None and stream and prompt_logprobs > 0:
            raise bad_request("'prompt_logprobs' are not available when streaming (as in vLLM)", "prompt_logprobs")
        self.req.stream = stream
        self.req.include_usage = bool(options and options.include_usage)
        self.req.continuous_usage = bool(options and options.continuous_usage_stats)

    def choices(self, n: int, best_of: int | None = None) -> None:
        """n, and vLLM's best_of: at least n (vLLM's rule and words), and not more than 1 (vLLM V1 serves none)."""
        if not 1 <= n <= MAX_CHOICES:
            raise bad_request(f"'n' must be an integer in [1, {MAX_CHOICES}]", "n")
        if best_of is not None and best_of < n:
            raise bad_request(f"best_of must be greater than or equal to n, got n={n} and best_of={best_of}.",
                              "best_of")
        if best_of is not None and best_of > 1:
            raise bad_request("'best_of' is not supported (vLLM V1 does not support it either)", "best_of")
        self.req.n = n

    def stop(self, stop: str | list[str] | None, include_in_output: bool = False) -> None:
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if len(stops) > MAX_STOP_STRINGS or sum(map(len, stops)) > MAX_STOP_CHARS:
            raise bad_request(f"'stop' takes at most {MAX_STOP_STRINGS} strings of {MAX_STOP_CHARS} characters in "
                              "all", "stop")
        self.req.stop, self.req.include_stop_str_in_output = stops, include_in_output

    def priority(self, priority: int) -> None:
        """vLLM's request priority; whether the replicas schedule by it is router.admission's to check."""
        if priority and not -2**31 <= priority < 2**31:
            raise bad_request(f"'priority' must be a 32-bit integer, got {priority}", "priority")
        self.per_request(priority=priority)

    def per_request(self, **values) -> None:
        """Fields every choice's engine request carries as they are given (stagemesh.core.engine_request; None:
        not given), checked by the door's schema (router.protocol for HTTP)."""
        self.req.engine = replace(self.req.engine, **{k: v for k, v in values.items() if v is not None})

    def truncation(self, truncate_prompt_tokens: int | None, side: str | None) -> None:
        if side not in (None, "left", "right"):  # (the HTTP schema refuses it first, in these words)
            raise bad_request("'truncation_side': Input should be 'left' or 'right'", "truncation_side")
        if truncate_prompt_tokens is not None and (truncate_prompt_tokens < -1 or truncate_prompt_tokens == 0):
            raise bad_request("'truncate_prompt_tokens' must be -1 (the model's length) or an integer >= 1",
                              "truncate_prompt_tokens")
        self.req.truncate_prompt_tokens, self.req.truncation_side = truncate_prompt_tokens, side or "left"

    def prompts(self, prompts: list[Prompt]) -> None:
        if not prompts or any(not (p.text or p.token_ids) for p in prompts):
            raise bad_request("'prompt' must not be empty (nor any prompt in it)", "prompt")
        self.req.prompts = prompts

    def tools(self, tools, tool_choice, parallel_tool_calls, tool_call_parser: str | None) -> None:
        try:
            self.req.tool_plan = plan_tools(tools, tool_choice, parallel_tool_calls, tool_call_parser)
        except InvalidParameter as err:
            raise bad_request(str(err), err.param) from None

    def conversation(self, messages: list[ChatMessage], add_generation_prompt: bool = True,
                     continue_final_message: bool = False, template: str | None = None, kwargs: dict | None = None,
                     documents: list | None = None) -> None:
        if not messages:  # (the HTTP schema refuses it first, in these words)
            raise bad_request("'messages' must be a non-empty array of messages, got an array", "messages")
        options = chat_options(messages, add_generation_prompt, continue_final_message, template, kwargs, documents)
        if self.req.tool_plan is not None:  # the template writes the tools into the prompt, as the model learnt
            options.template_kwargs["tools"] = self.req.tool_plan.tools
        self.req.chat_options = options

    def reasoning(self, parser: str | None, template_thinks: bool, include: bool = True) -> None:
        """How the answer's reasoning is split off (--reasoning-parser): after conversation(), whose template and
        its kwargs say whether the output starts in thinking (router.reasoning)."""
        options = self.req.chat_options
        assert options is not None  # (a chat: conversation() came first)
        thinks = template_thinks if options.chat_template is None else reasoning.template_thinks(options.chat_template)
        self.req.reasoning = reasoning.plan(parser, thinks, options.template_kwargs, include)
        if parser == reasoning.HARMONY:
            plan = self.req.tool_plan
            if plan is not None and plan.mode in ("required", "named"):
                raise bad_request(HARMONY_FORCED, "tool_choice")
            for message in options.messages:  # gpt-oss's template writes an earlier turn's analysis from `thinking`
                thought = message.get("reasoning", message.get("reasoning_content"))
                if message["role"] == "assistant" and thought is not None:
                    message.setdefault("thinking", thought)
            self.req.skip_special_tokens = False  # (the channels' headers are special tokens: router.harmony)

    def reasoning_effort(self, effort: str | None) -> None:
        """vLLM's reasoning_effort: given to the chat template (gpt-oss's reads it), unless its kwargs set it."""
        options = self.req.chat_options
        if effort is not None and options is not None:
            options.template_kwargs.setdefault("reasoning_effort", effort)

    def logprobs(self, name: str, value: int | None) -> int | None:
        """A count of top logprobs (logprobs, top_logprobs), checked by vLLM's limit."""
        if value is not None and not 0 <= value <= MAX_LOGPROBS:
            raise bad_request(f"'{name}' must be an integer in [0, {MAX_LOGPROBS}] (vLLM's --max-logprobs "
                              f"default; -1, the whole vocabulary, is not served)", name)
        return value

    def max_tokens(self, max_tokens: int | None, param: str = "max_tokens", echo_only: bool = False) -> None:
        """max_tokens as given in `param` (None: the model's default, else what the context leaves;
        router.choices.fit_max_tokens settles it per prompt, under the model's cap)."""
        req = self.req
        req.echo_only, req.max_tokens_param = echo_only, param
        req.max_tokens_given = max_tokens is not None and not echo_only
        req.max_tokens_default, req.max_tokens_cap = self.defaults.max_tokens, self.defaults.max_tokens_cap
        with _named(req):
            if req.max_tokens_given:
                check_int("max_tokens", max_tokens)
        # not given: the model's default, or the room the prompt leaves (router.choices.fit_max_tokens), the
        # most until then, so that min_tokens is checked against that room, as vLLM checks it
        self._max_tokens = 1 if echo_only else (max_tokens or req.max_tokens_default or INT32_MAX)

    def sampling(self, values: dict, constraint: StructuredOutputs | None = None,
                 structured_param: str = "structured_outputs", neutral: dict | None = None) -> None:
        """The sampling parameters (SamplingParams' keyword values, but max_tokens and the output constraint),
        checked by the rules every service shares; a tool plan's constraint joins the request's own. A value the
        request leaves out is the model's default (its generation config), else the door's `neutral` one, else
        SamplingParams' own."""
        req = self.req
        values = self.defaults.fill(values, neutral)
        req.structured_param = structured_param
        with _named(req):
            forced = req.tool_plan.constraint if req.tool_plan is not None else None
            if forced is not None:  # tool_choice required / named: the calls' JSON schema is the constraint
                if constraint is not None:
                    raise InvalidParameter(structured_param, f"one output constraint at a time: 'tool_choice' and "
                                                             f"'{structured_param}' are both given")
                constraint, req.structured_param = forced, "tool_choice"
            if constraint is not None and req.reasoning is not None and req.reasoning.implicit:
                raise InvalidParameter(req.structured_param, REASONING_CONSTRAINT.format(req.structured_param))
            req.sampling = SamplingParams(**values, max_tokens=self._max_tokens, structured=constraint)

    def build(self) -> GenerateRequest:
        req = self.req
        if req.num_choices > MAX_CHOICES:
            raise bad_request(f"the request asks for {req.num_choices} choices (prompts x n); at most {MAX_CHOICES}",
                              "n")
        return req


@contextmanager
def _named(req: GenerateRequest):
    """A broken sampling rule as a 400 that names the field the value came in (max_completion_tokens, ...)."""
    try:
        yield
    except InvalidParameter as err:
        renamed: dict[str | None, str | None] = {"max_tokens": req.max_tokens_param,
                                                 "structured_outputs": req.structured_param}
        name = renamed.get(err.param, err.param)
        raise bad_request(str(err).replace("'max_tokens'", f"'{name}'"), name) from None


def chat_options(messages: list[ChatMessage], add_generation_prompt: bool, continue_final_message: bool,
                 template: str | None, kwargs: dict | None, documents: list | None) -> ChatOptions:
    """A conversation as the chat template takes it, checked (chat completions, tokenize, both doors)."""
    if continue_final_message and add_generation_prompt:  # vLLM's rule: set add_generation_prompt false
        raise bad_request("'continue_final_message' and 'add_generation_prompt' cannot both be true",
                          "continue_final_message")
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
    out: dict[str, Any] = {"role": m.role, "content": content}  # the developer role goes to the template as it is
    for key in ("name", "tool_call_id", "reasoning", "reasoning_content"):
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
