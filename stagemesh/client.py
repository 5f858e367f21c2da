"""A small client for the router's gRPC frontend (stagemesh.v1.Frontend), sync and asyncio.

    from stagemesh.client import Client
    with Client("127.0.0.1:50050") as client:
        print(client.chat([{"role": "user", "content": "What is the capital of France?"}], max_tokens=32))
        for delta in client.generate("Once upon a time", max_tokens=20, stream=True):
            print(delta.text, end="", flush=True)
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import AsyncIterator, Iterator

import grpc

from stagemesh.core.sampling_params import SamplingParams
from stagemesh.v1 import frontend_pb2, frontend_pb2_grpc
from stagemesh.core.wire import sampling_to_pb


@dataclass
class Completion:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0


def _sampling(max_tokens: int | None, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens or 1, **kw)


def _generate_request(prompt: str | list[int], model: str, stop, max_tokens, kw) -> frontend_pb2.GenerateRequest:
    msg = frontend_pb2.GenerateRequest(model=model, stop=list(stop or []))
    if isinstance(prompt, str):
        msg.text = prompt
    else:
        msg.token_ids.ids.extend(prompt)
    sampling_to_pb(_sampling(max_tokens, **kw), msg.sampling)
    if max_tokens is None:
        msg.sampling.max_tokens = 0  # the router fills what the context leaves
    return msg


def _chat_request(messages: list[dict], model: str, stop, max_tokens, kw) -> frontend_pb2.ChatRequest:
    msg = frontend_pb2.ChatRequest(model=model, stop=list(stop or []),
                                   messages=[frontend_pb2.ChatMessage(role=m["role"], content=m["content"])
                                             for m in messages])
    sampling_to_pb(_sampling(max_tokens, **kw), msg.sampling)
    if max_tokens is None:
        msg.sampling.max_tokens = 0
    return msg


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
    done.token_ids.extend(reply.token_ids)
    if reply.finish_reason:
        done.finish_reason = reply.finish_reason
        done.prompt_tokens, done.completion_tokens = reply.usage.prompt_tokens, reply.usage.completion_tokens
    return done


class Client:
    """Blocking client. generate()/chat() return a Completion, or with stream=True an iterator of deltas."""

    def __init__(self, target: str = "127.0.0.1:50050", model: str = "", timeout: float | None = 300.0,
                 tls_ca: str | None = None, tls_cert: str | None = None, tls_key: str | None = None,
                 api_key: str | None = None):
        creds = _credentials(tls_ca, tls_cert, tls_key)
        self.channel = grpc.secure_channel(target, creds) if creds else grpc.insecure_channel(target)
        self.stub = frontend_pb2_grpc.FrontendStub(self.channel)
        self.model, self.timeout = model, timeout
        metadata = (("authorization", f"Bearer {api_key}"),) if api_key else None
        self._long, self._short = {"timeout": timeout, "metadata": metadata}, {"timeout": 30, "metadata": metadata}

    def generate(self, prompt: str | list[int], *, max_tokens: int | None = None, stop=None, stream: bool = False,
                 **sampling) -> Completion | Iterator[frontend_pb2.GenerateResponse]:
        replies = self.stub.Generate(_generate_request(prompt, self.model, stop, max_tokens, sampling),
                                     **self._long)
        return replies if stream else _collect(replies)

    def chat(self, messages: list[dict], *, max_tokens: int | None = None, stop=None, stream: bool = False,
             **sampling) -> Completion | Iterator[frontend_pb2.GenerateResponse]:
        replies = self.stub.Chat(_chat_request(messages, self.model, stop, max_tokens, sampling), **self._long)
        return replies if stream else _collect(replies)

    def tokenize(self, text: str) -> list[int]:
        return list(self.stub.Tokenize(frontend_pb2.TokenizeRequest(text=text), **self._short).token_ids)

    def models(self) -> list[str]:
        return list(self.stub.ListModels(frontend_pb2.ListModelsRequest(), **self._short).models)

    def close(self) -> None:
        self.channel.close()

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

    def __init__(self, target: str = "127.0.0.1:50050", model: str = "", timeout: float | None = 300.0,
                 tls_ca: str | None = None, tls_cert: str | None = None, tls_key: str | None = None,
                 api_key: str | None = None):
        creds = _credentials(tls_ca, tls_cert, tls_key)
        self.channel = grpc.aio.secure_channel(target, creds) if creds else grpc.aio.insecure_channel(target)
        self.stub = frontend_pb2_grpc.FrontendStub(self.channel)
        self.model, self.timeout = model, timeout
        metadata = (("authorization", f"Bearer {api_key}"),) if api_key else None
        self._long, self._short = {"timeout": timeout, "metadata": metadata}, {"timeout": 30, "metadata": metadata}

    def generate(self, prompt, *, max_tokens=None, stop=None, stream=False, **sampling):
        call = self.stub.Generate(_generate_request(prompt, self.model, stop, max_tokens, sampling),
                                  **self._long)
        return call if stream else _acollect(call)

    def chat(self, messages, *, max_tokens=None, stop=None, stream=False, **sampling):
        call = self.stub.Chat(_chat_request(messages, self.model, stop, max_tokens, sampling), **self._long)
        return call if stream else _acollect(call)

    async def tokenize(self, text: str) -> list[int]:
        return list((await self.stub.Tokenize(frontend_pb2.TokenizeRequest(text=text), **self._short)).token_ids)

    async def models(self) -> list[str]:
        return list((await self.stub.ListModels(frontend_pb2.ListModelsRequest(), **self._short)).models)

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


async def _acollect(call: AsyncIterator[frontend_pb2.GenerateResponse]) -> Completion:
    done = Completion()
    async for reply in call:
        _fold(done, reply)
    return done
