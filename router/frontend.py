"""The router's gRPC frontend (grpc.aio): the same generation path as HTTP, with
generated stubs on the client side; grpc.health.v1 and reflection included."""
from __future__ import annotations

import asyncio
import json
import logging
import uuid

import grpc
from grpc_health.v1 import health, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from router import choices
from router.admission import launch
from router.config import RouterConfig
from router.errors import APIError, bad_request
from router.prompts import render
from router.protocol import ChatCompletionRequest, ChatMessage, checked_field
from router.replica_set import ReplicaSet
from router.request import GenerateRequest, Prompt
from router.request_builder import RequestBuilder, chat_options
from router.resume import EventIds, ResumePoint
from router.state import Lifecycle, checked_request_id
from router.tokenization import Tokenizer
from stagemesh.core import telemetry
from stagemesh.core.errors import StagemeshError
from stagemesh.core.grpc_errors import ErrorInterceptor
from stagemesh.core.health import follow
from stagemesh.core.sampling_params import MAX_LOGPROBS, InvalidParameter, check_int
from stagemesh.core.service_options import add_port, quiet_grpc_teardown
from stagemesh.core.step_wire import logprob_to_pb
from stagemesh.core.wire import sampling_fields_from_pb
from stagemesh.v1 import frontend_pb2, frontend_pb2_grpc

STATUS = {400: grpc.StatusCode.INVALID_ARGUMENT, 401: grpc.StatusCode.UNAUTHENTICATED, 404: grpc.StatusCode.NOT_FOUND,
          429: grpc.StatusCode.RESOURCE_EXHAUSTED, 503: grpc.StatusCode.UNAVAILABLE}
log = logging.getLogger("stagemesh.router")


def status_of(err: Exception) -> tuple[grpc.StatusCode, str] | None:
    """An APIError's HTTP status as a gRPC code, with its message (None: not an APIError, a bug)."""
    if isinstance(err, APIError):
        return STATUS.get(err.status, grpc.StatusCode.INTERNAL), err.message
    return None


class FrontendServicer(frontend_pb2_grpc.FrontendServicer):
    def __init__(self, replicas: ReplicaSet, tokenizer: Tokenizer, config: RouterConfig,
                 lifecycle: Lifecycle | None = None):
        self.replicas, self.tokenizer, self.config = replicas, tokenizer, config
        self.lifecycle = lifecycle or Lifecycle()  # shared with the HTTP door: draining, requests served
        self.health_task: asyncio.Task | None = None

    def _request(self, request, chat: bool) -> GenerateRequest:
        """A Generate or Chat request through the request builder, step by step as the HTTP door's."""
        b = RequestBuilder(self.config.served_model_name, request.model or None, chat, self.config.adapter_names,
                           self.config.sampling_defaults)
        b.choices(request.n or 1, _given(request, "best_of"))
        b.stop(list(request.stop), request.include_stop_str_in_output)
        b.priority(request.priority)
        b.per_request(cache_salt=request.cache_salt or None)  # (proto3: empty is unset, no salt)
        _decoding(b.req, request, chat)
        b.truncation(_given(request, "truncate_prompt_tokens"), request.truncation_side or None)
        if chat:
            if request.tools:
                raise bad_request("'tools' are not served by the gRPC frontend: its replies cannot carry a tool call "
                                  "(use the HTTP API's chat completions)", "tools")
            b.conversation(_messages(request), *_chat_args(request))
            b.reasoning(self.config.reasoning_parser, self.config.template_thinks)
        else:
            b.prompts(_prompts(request))
        try:
            _check_wire_ints(request.sampling)
            values = sampling_fields_from_pb(request.sampling)
        except InvalidParameter as err:  # an output constraint that breaks its own rules, ...
            raise bad_request(str(err), err.param) from None
        values.pop("max_tokens")
        constraint = values.pop("structured")
        b.logprobs("logprobs", values["logprobs"])
        b.max_tokens(request.sampling.max_tokens or None)  # (0: not given, the room the context leaves)
        b.sampling(values, constraint)
        return b.build()

    async def Generate(self, request, context):
        async for reply in self._run(request, context, chat=False):
            yield reply

    async def Chat(self, request, context):
        async for reply in self._run(request, context, chat=True):
            yield reply

    async def _run(self, request, context, chat: bool):
        if self.lifecycle.draining:  # (a stagemesh.client resumes it on another router)
            raise APIError(503, "this router is shutting down: send the request to another one")
        self.lifecycle.active += 1
        try:
            async for reply in self._answer(request, chat):
                yield reply
        finally:
            self.lifecycle.active -= 1

    async def _answer(self, request, chat: bool):
        req = self._request(request, chat)
        request_id = checked_request_id(request.request_id) if request.request_id else uuid.uuid4().hex
        _resume(req, request)
        prompts, gens = await launch(req, self.replicas, self.tokenizer, self.config.max_model_len,
                                     f"{'chatcmpl' if chat else 'cmpl'}-{request_id}")
        usage = frontend_pb2.Usage(prompt_tokens=len(prompts[0]))
        ids = EventIds(req.num_choices, req.resume, enabled=False)  # a resume sends only what its client lacks
        splits = {g.index: req.reasoning.splitter() for g in gens} if req.reasoning else {}
        first = True
        async for gen, d in choices.run(req, gens, self.replicas, self.tokenizer):
            reasoning, text = splits[gen.index].feed(d.text, bool(d.finish_reason)) if splits else ("", d.text)
            if not ids.delta(gen.index, len(d.token_ids), bool(d.finish_reason), [d]):
                continue
            reply = frontend_pb2.GenerateResponse(text=text, reasoning=reasoning, token_ids=d.token_ids,
                                                  index=gen.index,
                                                  finish_reason=d.finish_reason or "",
                                                  prompt_logprobs=[logprob_to_pb(e) for e in d.prompt_logprobs],
                                                  prompt_logprobs_start=d.prompt_logprobs_start,
                                                  request_id=request_id if first else "")
            first = False
            reply.logprobs.extend(logprob_to_pb(e) for e in d.logprobs)
            if d.finish_reason:
                usage.completion_tokens = sum(g.completion_tokens for g in gens)
                usage.cached_tokens = sum(g.cached_tokens for g in gens)
                reply.usage.CopyFrom(usage)
            yield reply

    async def Tokenize(self, request, context):
        if request.WhichOneof("input") == "chat":
            chat = request.chat
            ids = await render(chat_options(_messages(chat), *_chat_args(chat)), self.tokenizer,
                               bool(_given(chat, "add_special_tokens")))
        else:
            self.tokenizer.check_length(len(request.text), "text")
            ids = await self.tokenizer.run(self.tokenizer.encode, request.text)
        return frontend_pb2.TokenizeResponse(token_ids=ids, max_model_len=self.replicas.max_model_len)

    async def ListModels(self, request, context):
        return frontend_pb2.ListModelsResponse(models=[self.config.served_model_name, *self.config.adapter_names],
                                               max_model_len=self.replicas.max_model_len)


def _check_wire_ints(sampling) -> None:
    """The integers the wire reads past their rules (0 and -1 are top-k off, -1 is no logprobs, as the proto
    says): anything below is the 400 the HTTP door gives, not read as off."""
    check_int("top_k", sampling.top_k)
    if sampling.logprobs < -1:
        raise InvalidParameter("logprobs", f"'logprobs' must be -1 (none) or an integer in [0, {MAX_LOGPROBS}], got "
                                           f"{sampling.logprobs}")


def _resume(req: GenerateRequest, request) -> None:
    """A request that names its id is resumable (router.resume); with `resume` it is a resume."""
    req.resumable = bool(request.request_id)
    if not request.HasField("resume"):
        return
    progress = [(c.tokens, c.finished) for c in request.resume.choices]
    if not request.request_id:
        raise bad_request("'resume' resumes the stream of a request id: send it ('request_id')", "request_id")
    if len(progress) != req.num_choices or any(t < 0 for t, _ in progress):
        raise bad_request(f"'resume' must give each of the request's {req.num_choices} choice(s) once, with tokens "
                          ">= 0", "resume")
    req.resume = ResumePoint.of_progress(progress)


def _given(request, name: str):
    """An optional field's value (None: not given)."""
    return getattr(request, name) if request.HasField(name) else None


def _decoding(req: GenerateRequest, request, chat: bool) -> None:
    """How the prompt is tokenized and the answer decoded: values any of which is valid (bad_words are
    tokenized and bounded with the prompt, router.prompts), set as the HTTP door sets them."""
    if request.bad_words and request.sampling.bad_words:
        raise bad_request("'bad_words' (words) and 'sampling.bad_words' (token ids) cannot both be given: send "
                          "one", "bad_words")
    req.bad_words = list(request.bad_words)
    given = _given(request, "add_special_tokens")
    req.add_special_tokens = (not chat) if given is None else given
    skip, spaces = _given(request, "skip_special_tokens"), _given(request, "spaces_between_special_tokens")
    req.skip_special_tokens = True if skip is None else skip
    req.spaces_between_special_tokens = True if spaces is None else spaces


def _messages(chat) -> list[ChatMessage]:
    return [ChatMessage(role=m.role, content=m.content) for m in chat.messages]


def _chat_args(chat) -> tuple:
    """A ChatRequest's template options, in the order of RequestBuilder.conversation's (and chat_options')."""
    generation_prompt = _given(chat, "add_generation_prompt")
    return (True if generation_prompt is None else generation_prompt, chat.continue_final_message,
            _given(chat, "chat_template"), _json_field(chat, "chat_template_kwargs"), _json_field(chat, "documents"))


def _json_field(chat, name: str):
    """A field that comes as JSON text, read and checked by the HTTP schema's type for it (None: empty)."""
    text = getattr(chat, name)
    if not text:
        return None
    try:
        value = json.loads(text)
    except ValueError:
        raise bad_request(f"'{name}' must be JSON text", name) from None
    return checked_field(ChatCompletionRequest, name, value)


def _prompts(request) -> list[Prompt]:
    kind = request.WhichOneof("prompt")
    if kind == "token_ids":
        return [Prompt(token_ids=list(request.token_ids.ids))]
    return [Prompt(text=request.text)] if kind == "text" else []


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """--api-key on the gRPC frontend: 'authorization: Bearer KEY' metadata, as on the HTTP API."""

    def __init__(self, api_key: str):
        self.expected = f"Bearer {api_key}"

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or not details.method.startswith("/stagemesh.v1.Frontend/"):
            return handler  # health and reflection stay open
        if dict(details.invocation_metadata or ()).get("authorization") == self.expected:
            return handler
        message = "a valid API key is required: send metadata 'authorization: Bearer KEY'"

        async def deny(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

        async def deny_stream(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
            yield  # pragma: no cover - abort raises

        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(deny_stream, handler.request_deserializer,
                                                        handler.response_serializer)
        return grpc.unary_unary_rpc_method_handler(deny, handler.request_deserializer, handler.response_serializer)


async def serve_frontend(servicer: FrontendServicer, host: str, port: int) -> tuple[grpc.aio.Server, int]:
    key = servicer.config.api_key
    interceptors: list = [ApiKeyInterceptor(key)] if key else []
    if telemetry.enabled():
        from opentelemetry.instrumentation.grpc import aio_server_interceptor

        interceptors.append(aio_server_interceptor())
    quiet_grpc_teardown(asyncio.get_running_loop())
    server = grpc.aio.server(interceptors=[*interceptors, ErrorInterceptor(status_of, log)])
    frontend_pb2_grpc.add_FrontendServicer_to_server(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = (frontend_pb2.DESCRIPTOR.services_by_name["Frontend"].full_name, health.SERVICE_NAME,
             reflection.SERVICE_NAME)
    reflection.enable_server_reflection(names, server)
    bound = add_port(server, f"{host}:{port}")
    if bound == 0:
        raise StagemeshError(f"cannot listen on {host}:{port} for the gRPC frontend")
    await server.start()
    # referenced by the servicer for as long as the server runs (a task nobody holds may be collected)
    servicer.health_task = asyncio.create_task(follow(health_servicer, ("stagemesh.v1.Frontend",),
                                                      lambda: bool(servicer.replicas.healthy())
                                                      and not servicer.lifecycle.draining, interval_s=0.5))
    return server, bound

