"""The router's gRPC frontend (grpc.aio): the same generation path as HTTP, with
generated stubs on the client side; grpc.health.v1 and reflection included."""
from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from router.errors import APIError
from router.generation import Generation, fit_max_tokens, generate, new_request_id, prompt_ids_for
from router.openai_protocol import GenerateRequest
from router.replicas import ReplicaSet
from router.tokenization import Tokenizer
from stagemesh import telemetry
from stagemesh.errors import StagemeshError
from stagemesh.health import follow
from stagemesh.service_options import add_port
from stagemesh.v1 import common_pb2, frontend_pb2, frontend_pb2_grpc
from stagemesh.wire import sampling_from_pb

MAX_STOP_STRINGS, MAX_STOP_CHARS = 64, 4096
STATUS = {400: grpc.StatusCode.INVALID_ARGUMENT, 401: grpc.StatusCode.UNAUTHENTICATED, 404: grpc.StatusCode.NOT_FOUND,
          429: grpc.StatusCode.RESOURCE_EXHAUSTED, 503: grpc.StatusCode.UNAVAILABLE}


class FrontendServicer(frontend_pb2_grpc.FrontendServicer):
    def __init__(self, replicas: ReplicaSet, tokenizer: Tokenizer, config: dict):
        self.replicas, self.tokenizer, self.config = replicas, tokenizer, config

    def _request(self, model: str, sampling, stop, chat: bool) -> GenerateRequest:
        served = self.config["served_model_name"]
        if model and model != served:
            raise APIError(404, f"the model '{model}' does not exist; this server serves '{served}'")
        try:
            params = sampling_from_pb(sampling)
        except StagemeshError as err:
            raise APIError(400, str(err)) from None
        if len(stop) > MAX_STOP_STRINGS or sum(map(len, stop)) > MAX_STOP_CHARS:
            raise APIError(400, f"at most {MAX_STOP_STRINGS} stop strings of {MAX_STOP_CHARS} characters in all")
        return GenerateRequest(model=served, chat=chat, sampling=params, max_tokens_given=sampling.max_tokens > 0,
                               stop=list(stop), logprobs=params.logprobs is not None)

    async def Generate(self, request, context):
        async for reply in self._run(request, context, chat=False):
            yield reply

    async def Chat(self, request, context):
        async for reply in self._run(request, context, chat=True):
            yield reply

    def _parse(self, request, chat: bool) -> GenerateRequest:
        req = self._request(request.model, request.sampling, request.stop, chat)
        if chat:
            req.messages = [{"role": m.role, "content": m.content} for m in request.messages]
        elif request.WhichOneof("prompt") == "token_ids":
            req.prompt_ids = list(request.token_ids.ids)
        else:
            req.prompt_text = request.text
        if not chat and not (req.prompt_text or req.prompt_ids):
            raise APIError(400, "the prompt is empty")
        return req

    async def _run(self, request, context, chat: bool):
        try:
            req = self._parse(request, chat)
            prompt_ids = await prompt_ids_for(req, self.tokenizer)
            fit_max_tokens(req, len(prompt_ids), self._max_len())
            gen = Generation(new_request_id(req.chat), prompt_ids)
            async for d in generate(req, gen, self.replicas, self.tokenizer):
                reply = frontend_pb2.GenerateResponse(text=d.text, token_ids=d.token_ids,
                                                      finish_reason=d.finish_reason or "")
                reply.logprobs.extend(common_pb2.TokenLogprob(token_id=e.token_id, logprob=e.logprob,
                                                              top_token_ids=e.top_token_ids,
                                                              top_logprobs=e.top_logprobs) for e in d.logprobs)
                if d.finish_reason:
                    reply.usage.CopyFrom(frontend_pb2.Usage(prompt_tokens=len(prompt_ids),
                                                            completion_tokens=gen.completion_tokens,
                                                            cached_tokens=gen.cached_tokens))
                yield reply
        except APIError as err:
            await context.abort(STATUS.get(err.status, grpc.StatusCode.INTERNAL), err.message)

    def _max_len(self) -> int:
        if not self.replicas.healthy():
            raise APIError(503, "no healthy replica")
        return min(filter(None, (self.replicas.max_model_len, self.config.get("max_model_len"))))

    async def Tokenize(self, request, context):
        try:
            if request.WhichOneof("input") == "chat":
                req = GenerateRequest(model="", chat=True,
                                      messages=[{"role": m.role, "content": m.content} for m in request.chat.messages])
                ids = await prompt_ids_for(req, self.tokenizer)
            else:
                self.tokenizer.check_length(len(request.text), "text")
                ids = await self.tokenizer.run(self.tokenizer.encode, request.text)
        except APIError as err:
            await context.abort(STATUS.get(err.status, grpc.StatusCode.INTERNAL), err.message)
        return frontend_pb2.TokenizeResponse(token_ids=ids, max_model_len=self.replicas.max_model_len)

    async def ListModels(self, request, context):
        return frontend_pb2.ListModelsResponse(models=[self.config["served_model_name"]],
                                               max_model_len=self.replicas.max_model_len)


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
    interceptors: list = [ApiKeyInterceptor(servicer.config["api_key"])] if servicer.config.get("api_key") else []
    if telemetry.enabled():
        from opentelemetry.instrumentation.grpc import aio_server_interceptor

        interceptors.append(aio_server_interceptor())
    server = grpc.aio.server(interceptors=interceptors)
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
    asyncio.create_task(follow(health_servicer, ("stagemesh.v1.Frontend",), lambda: bool(servicer.replicas.healthy()),
                               interval_s=0.5))
    return server, bound

