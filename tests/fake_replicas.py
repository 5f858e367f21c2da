"""The router's HTTP app in this process over a fake replica: for tests of request parsing and the
generation logic that need no model's real tokens (no scheduler, no stage, no start-up to wait for).

The fake replica answers a request with the tokens first_token, first_token + 1, ... (first_token is the
prompt's last token + 1, wrapped in the vocabulary), one output per token, ending with "length" at
max_tokens (or at a stop token id it meets), as a replica's SubmitStream does. A continuation (generated
tokens given) goes on from them. fail_after=N: a request fails with UNAVAILABLE after its N-th token there,
as when the replica dies.
"""
from __future__ import annotations

import asyncio
import threading

from aiohttp import web

from router.app import build_app
from router.balancing import LeastLoad
from router.config import RouterConfig
from router.frontend import FrontendServicer, serve_frontend
from router.http_server import GatewayRunner
from router.replica_set import ReplicaSet
from router.replicas import Replica
import grpc

from router.submit_stream import ReplicaOutput, RequestFailed
from router.tokenization import Tokenizer
from stagemesh.core.engine_request import EngineRequest
from stagemesh.core.model_config import ModelConfig
from stagemesh.core.sampling_params import SamplingParams


class FakeReplica(Replica):
    def __init__(self, served_model_name: str, max_model_len: int, vocab_size: int, eos_token_ids=(),
                 address: str = "fake:0", scheduling_policy: str = "fcfs"):
        super().__init__(address, healthy=True, reason="", max_model_len=max_model_len,
                         eos_token_ids=tuple(eos_token_ids), served_model_name=served_model_name,
                         scheduling_policy=scheduling_policy)
        self.vocab_size = vocab_size
        self.fail_after: int | None = None
        self.submitted: list[tuple[str, list[int], SamplingParams]] = []
        self.generated: list[list[int]] = []  # of each submit: the tokens a continuation brought
        self.priorities: list[int] = []  # of each submit
        self.requests: list[EngineRequest] = []  # each submit, whole

    def __post_init__(self) -> None:  # no channel: nothing to dial
        self._stream = None

    def submit(self, request: EngineRequest) -> "FakeStream":
        r = request
        assert not r.prefill_only and not r.kv_source, "a fake replica is never part of a disaggregated mesh"
        assert not r.lora_name, "a fake replica serves no LoRA adapter"
        prompt = list(r.prompt_token_ids)
        self.submitted.append((r.request_id, prompt, r.sampling))
        self.priorities.append(r.priority)
        self.requests.append(r)
        self.generated.append(list(r.generated_token_ids))
        return FakeStream(self._outputs(prompt, r.sampling, len(r.generated_token_ids)))

    def attach(self, request_id: str, prompt: list[int], owner: str) -> "FakeStream":
        """A fake replica keeps nothing for a resume."""
        async def none():
            raise RequestFailed(grpc.StatusCode.NOT_FOUND, f"no request {request_id!r} is held here")
            yield  # pragma: no cover
        return FakeStream(none())

    async def _outputs(self, prompt: list[int], sampling: SamplingParams, num_generated: int):
        token = (prompt[-1] + 1 + num_generated) % self.vocab_size
        for i in range(num_generated, sampling.max_tokens):
            await asyncio.sleep(0)
            if self.fail_after is not None and i - num_generated == self.fail_after:
                self.healthy = False
                raise RequestFailed(grpc.StatusCode.UNAVAILABLE, f"replica {self.address} died")
            stop = token in sampling.stop_token_ids
            last = stop or i + 1 == sampling.max_tokens
            yield ReplicaOutput([token], finish_reason=("stop" if stop else "length") if last else None,
                                stop_token_id=token if stop else None,
                                num_prompt_tokens=len(prompt) if i == num_generated else 0)
            if last:
                return
            token = (token + 1) % self.vocab_size

    async def close(self) -> None:
        pass


class FakeStream:
    """A request's outputs, as router.submit_stream.RequestStream gives them; close() ends it."""

    def __init__(self, outputs):
        self._outputs, self.closed = outputs, False

    def __aiter__(self) -> "FakeStream":
        return self

    async def __anext__(self) -> ReplicaOutput:
        if self.closed:
            raise StopAsyncIteration
        return await self._outputs.__anext__()

    def close(self) -> None:
        self.closed = True

    def release(self) -> None:
        pass


class FakeRouter:
    """The router's app on a loopback port, served by an event loop on a thread of its own."""

    def __init__(self, model_dir, served_model_name: str, api_key: str | None = None, num_replicas: int = 1,
                 max_request_retries: int = 3, scheduling_policy: str = "fcfs", grpc_frontend: bool = False,
                 replica_class: type[FakeReplica] = FakeReplica, **config):
        """replica_class: FakeReplica or one that answers otherwise (its _outputs)."""
        cfg = ModelConfig.from_path(model_dir)
        self.replicas = [replica_class(served_model_name, 512, cfg.vocab_size, cfg.eos_token_ids, f"fake:{i}",
                                     scheduling_policy) for i in range(num_replicas)]
        self.replica = self.replicas[0]
        replicas = ReplicaSet([], LeastLoad(), max_request_retries=max_request_retries)
        replicas.replicas = list(self.replicas)
        router_config = RouterConfig(served_model_name, api_key, **config)
        tokenizer = Tokenizer(model_dir, cfg.max_position_embeddings, router_config.template_timeout_s)
        self.app = build_app(replicas, tokenizer, router_config)
        # the gRPC frontend beside it (grpc_port), on the same replicas
        self.frontend = FrontendServicer(replicas, tokenizer, router_config) if grpc_frontend else None
        self.grpc_port: int | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    def __enter__(self) -> "FakeRouter":
        self._thread.start()
        self.runner = GatewayRunner(self.app, access_log=None, handler_cancellation=True)
        asyncio.run_coroutine_threadsafe(self.runner.setup(), self._loop).result(30)
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        asyncio.run_coroutine_threadsafe(site.start(), self._loop).result(30)
        self.base_url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"
        if self.frontend is not None:
            self._grpc_server, self.grpc_port = asyncio.run_coroutine_threadsafe(
                serve_frontend(self.frontend, "127.0.0.1", 0), self._loop).result(30)
        return self

    def __exit__(self, *exc) -> None:
        if self.frontend is not None:
            self._loop.call_soon_threadsafe(self.frontend.health_task.cancel)
            asyncio.run_coroutine_threadsafe(self._grpc_server.stop(None), self._loop).result(30)
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    def client(self, **kw):
        import openai

        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key=kw.pop("api_key", "none"), max_retries=0, **kw)
