"""A small client for the router's gRPC frontend (stagemesh.v1.Frontend), sync and asyncio.

    from stagemesh.client import Client
    with Client(["127.0.0.1:50050", "127.0.0.1:50051"]) as client:
        print(client.chat([{"role": "user", "content": "What is the capital of France?"}], max_tokens=32))
        for delta in client.generate("Once upon a time", max_tokens=20, stream=True):
            print(delta.text, end="", flush=True)

Given several routers, a stream whose router goes away (UNAVAILABLE: it died or stopped) goes on on the next
one by itself: the client names each request (request_id) and sends it again with what it has of each choice
(resume); the router attaches it where its replica kept it and sends only the rest (router.resume).
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator, Iterator, Sequence

import grpc

from stagemesh.core.sampling_params import SamplingParams
from stagemesh.v1 import frontend_pb2, frontend_pb2_grpc
from stagemesh.core.wire import sampling_to_pb


@dataclass
class Completion:
    text: str = ""
    reasoning: str = ""  # chat under the router's --reasoning-parser: the model's thinking, split off text
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens found in the prefix cache


log = logging.getLogger("stagemesh.client")
RESUME_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)  # the router went away under the stream


@dataclass
class _Progress:
    """What a stream has delivered of each choice, for a resume on another router."""
    num_choices: int
    tokens: list[int] = field(default_factory=list)
    finished: list[bool] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.tokens, self.finished = [0] * self.num_choices, [False] * self.num_choices

    def add(self, reply: frontend_pb2.GenerateResponse) -> None:
        if 0 <= reply.index < self.num_choices:
            self.tokens[reply.index] += len(reply.token_ids)
            self.finished[reply.index] = self.finished[reply.index] or bool(reply.finish_reason)

    def started(self) -> bool:
        return any(self.tokens) or any(self.finished)

    def resume(self, msg) -> None:
        """Ask for the rest (nothing to resume yet: the request goes again from the start)."""
        msg.ClearField("resume")
        if self.started():
            msg.resume.choices.extend(frontend_pb2.ChoiceProgress(tokens=t, finished=f)
                                      for t, f in zip(self.tokens, self.finished))


@dataclass
class _Resumer:
    """Where the next try of a stream goes, and whether another is allowed."""
    targets: int
    max_resumes: int
    current: int = 0
    resumes: int = 0

    def next(self, err: grpc.RpcError, progress: _Progress, msg) -> float:
        """After `err` cut a stream: the seconds to wait before the next try (re-raises when there is none)."""
        code = err.code()
        lost = code == grpc.StatusCode.NOT_FOUND and msg.HasField("resume") and not progress.started()
        if self.resumes >= self.max_resumes or (code not in RESUME_CODES and not lost):
            raise err
        self.resumes += 1
        self.current = (self.current + 1) % self.targets
        progress.resume(msg)
        log.warning("the stream of %s broke (%s): resuming it on router %d (try %d of %d)", msg.request_id,
                    code.name, self.current, self.resumes, self.max_resumes)
        return min(0.1 * 2 ** (self.resumes - 1), 2.0)


# the sampling parameters a request may leave to the model's defaults (its generation config, on the router)
MODEL_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def _sampling(max_tokens: int | None, kw: dict, out) -> None:
    """The sampling parameters into `out`, checked here as the router checks them; max_tokens None goes as 0,
    the frontend's unset: the router settles it to the model's default or the room the context leaves, as for
    an HTTP request. The parameters of MODEL_DEFAULTS not given stay unset, for the model's defaults."""
    sampling_to_pb(SamplingParams(max_tokens=max_tokens or 1, **kw), out)
    for name in MODEL_DEFAULTS:
        if kw.get(name) is None:
            out.ClearField(name)
    if max_tokens is None:
        out.max_tokens = 0


# the request's own fields (not SamplingParams') a helper's keywords pass on as they are (frontend.proto says
# what each does); Chat's dicts and lists (chat_template_kwargs, documents, tools) go as JSON text
REQUEST_FIELDS = ("priority", "cache_salt", "include_stop_str_in_output", "skip_special_tokens",
                  "spaces_between_special_tokens", "truncate_prompt_tokens", "truncation_side", "add_special_tokens",
                  "bad_words", "best_of")
CHAT_FIELDS = REQUEST_FIELDS + ("add_generation_prompt", "continue_final_message", "chat_template",
                                "chat_template_kwargs", "documents", "tools")
JSON_FIELDS = ("chat_template_kwargs", "documents", "tools")


def _request(msg, fields: tuple[str, ...], stop, max_tokens, kw):
    """`msg` with the keywords that are request fields, the sampling parameters from the rest."""
    msg.stop.extend(stop or [])
    msg.n, msg.request_id = kw.pop("n", 1), kw.pop("request_id", None) or uuid.uuid4().hex
    for name in fields:
        value = kw.pop(name, None)
        if value is None:
            continue
        if name == "bad_words":
            msg.bad_words.extend(value)
        else:
            setattr(msg, name, json.dumps(value) if name in JSON_FIELDS else value)
    _sampling(max_tokens, kw, msg.sampling)
    return msg


def _generate_request(prompt: str | list[int], model: str, stop, max_tokens, kw) -> frontend_pb2.GenerateRequest:
    msg = frontend_pb2.GenerateRequest(model=model)
    if isinstance(prompt, str):
        msg.text = prompt
    else:
        msg.token_ids.ids.extend(prompt)
    return _request(msg, REQUEST_FIELDS, stop, max_tokens, kw)


def _chat_request(messages: list[dict], model: str, stop, max_tokens, kw) -> frontend_pb2.ChatRequest:
    msg = frontend_pb2.ChatRequest(model=model, messages=[frontend_pb2.ChatMessage(role=m["role"], content=m["content"])
                                                          for m in messages])
    return _request(msg, CHAT_FIELDS, stop, max_tokens, kw)


def _credentials(ca: str | None, cert: str | None, key: str | None) -> grpc.ChannelCredentials | None:
    """TLS to a router started with --tls-cert/--tls-key: verify it with ``ca``; ``cert``/``key`` for mutual TLS."""
    if ca is None and cert is None:
        return None
    from stagemesh.core.service_options import TLSConfig, channel_credentials

    def read(path: str | None) -> bytes | None:
        return None if path is None else open(path, "rb").read()

    return channel_credentials(TLSConfig(read(cert), read(key), read(ca)))


def _fold(done: Completion, reply: frontend_pb2.GenerateResponse) -> Completion:
    done.text += reply.text
    done.reasoning += reply.reasoning
    done.token_ids.extend(reply.token_ids)
    if reply.finish_reason:
        done.finish_reason = reply.finish_reason
        done.prompt_tokens, done.completion_tokens = reply.usage.prompt_tokens, reply.usage.completion_tokens
        done.cached_tokens = reply.usage.cached_tokens
    return done


def _targets(target: str | Sequence[str]) -> list[str]:
    targets = [target] if isinstance(target, str) else list(target)
    if not targets:
        raise ValueError("give at least one router address (host:port)")
    return targets


class Client:
    """Blocking client. generate()/chat() return a Completion, or with stream=True an iterator of deltas.
    `target`: a router's address, or several (a stream whose router goes away resumes on the next one, at most
    `max_resumes` times; n, request_id, the request's other fields (REQUEST_FIELDS, CHAT_FIELDS) and the sampling
    parameters go as keywords)."""

    def __init__(self, target: str | Sequence[str] = "127.0.0.1:50050", model: str = "",
                 timeout: float | None = 300.0, tls_ca: str | None = None, tls_cert: str | None = None,
                 tls_key: str | None = None, api_key: str | None = None, max_resumes: int = 8):
        creds = _credentials(tls_ca, tls_cert, tls_key)
        self.channels = [grpc.secure_channel(t, creds) if creds else grpc.insecure_channel(t)
                         for t in _targets(target)]
        self.stubs = [frontend_pb2_grpc.FrontendStub(c) for c in self.channels]
        self.channel, self.stub = self.channels[0], self.stubs[0]
        self.model, self.timeout, self.max_resumes = model, timeout, max_resumes
        metadata = (("authorization", f"Bearer {api_key}"),) if api_key else None
        self._long, self._short = {"timeout": timeout, "metadata": metadata}, {"timeout": 30, "metadata": metadata}

    def generate(self, prompt: str | list[int], *, max_tokens: int | None = None, stop=None, stream: bool = False,
                 **sampling) -> Completion | Iterator[frontend_pb2.GenerateResponse]:
        replies = self._resuming("Generate", _generate_request(prompt, self.model, stop, max_tokens, sampling))
        return replies if stream else _collect(replies)

    def chat(self, messages: list[dict], *, max_tokens: int | None = None, stop=None, stream: bool = False,
             **sampling) -> Completion | Iterator[frontend_pb2.GenerateResponse]:
        replies = self._resuming("Chat", _chat_request(messages, self.model, stop, max_tokens, sampling))
        return replies if stream else _collect(replies)

    def _resuming(self, method: str, msg) -> Iterator[frontend_pb2.GenerateResponse]:
        progress, resumer = _Progress(msg.n or 1), _Resumer(len(self.stubs), self.max_resumes)
        while True:
            try:
                for reply in getattr(self.stubs[resumer.current], method)(msg, **self._long):
                    progress.add(reply)
                    yield reply
                return
            except grpc.RpcError as err:
                time.sleep(resumer.next(err, progress, msg))

    def tokenize(self, text: str) -> list[int]:
        return list(self.stub.Tokenize(frontend_pb2.TokenizeRequest(text=text), **self._short).token_ids)

    def models(self) -> list[str]:
        return list(self.stub.ListModels(frontend_pb2.ListModelsRequest(), **self._short).models)

    def close(self) -> None:
        for channel in self.channels:
            channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _collect(replies) -> Completion:
    done = Completion()
    for reply in replies:
        _fold(done, reply)
    return done


class AsyncClient:
    """asyncio client with the same methods as Client (awaitable, or async iterators with stream=True)."""

    def __init__(self, target: str | Sequence[str] = "127.0.0.1:50050", model: str = "",
                 timeout: float | None = 300.0, tls_ca: str | None = None, tls_cert: str | None = None,
                 tls_key: str | None = None, api_key: str | None = None, max_resumes: int = 8):
        creds = _credentials(tls_ca, tls_cert, tls_key)
        self.channels = [grpc.aio.secure_channel(t, creds) if creds else grpc.aio.insecure_channel(t)
                         for t in _targets(target)]
        self.stubs = [frontend_pb2_grpc.FrontendStub(c) for c in self.channels]
        self.channel, self.stub = self.channels[0], self.stubs[0]
        self.model, self.timeout, self.max_resumes = model, timeout, max_resumes
        metadata = (("authorization", f"Bearer {api_key}"),) if api_key else None
        self._long, self._short = {"timeout": timeout, "metadata": metadata}, {"timeout": 30, "metadata": metadata}

    def generate(self, prompt, *, max_tokens=None, stop=None, stream=False, **sampling):
        replies = self._resuming("Generate", _generate_request(prompt, self.model, stop, max_tokens, sampling))
        return replies if stream else _acollect(replies)

    def chat(self, messages, *, max_tokens=None, stop=None, stream=False, **sampling):
        replies = self._resuming("Chat", _chat_request(messages, self.model, stop, max_tokens, sampling))
        return replies if stream else _acollect(replies)

    async def _resuming(self, method: str, msg) -> AsyncIterator[frontend_pb2.GenerateResponse]:
        progress, resumer = _Progress(msg.n or 1), _Resumer(len(self.stubs), self.max_resumes)
        while True:
            try:
                async for reply in getattr(self.stubs[resumer.current], method)(msg, **self._long):
                    progress.add(reply)
                    yield reply
                return
            except grpc.RpcError as err:
                await asyncio.sleep(resumer.next(err, progress, msg))

    async def tokenize(self, text: str) -> list[int]:
        return list((await self.stub.Tokenize(frontend_pb2.TokenizeRequest(text=text), **self._short)).token_ids)

    async def models(self) -> list[str]:
        return list((await self.stub.ListModels(frontend_pb2.ListModelsRequest(), **self._short)).models)

    async def close(self) -> None:
        for channel in self.channels:
            await channel.close()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


async def _acollect(call: AsyncIterator[frontend_pb2.GenerateResponse]) -> Completion:
    done = Completion()
    async for reply in call:
        _fold(done, reply)
    return done
