"""Send one benchmark request and time its stream: the OpenAI HTTP API or the gRPC frontend."""
from __future__ import annotations

import json
import time

from stagemesh.entry.bench import counting
from stagemesh.entry.bench.report import Result
from stagemesh.entry.bench.workload import BenchRequest


def _tokens_arrived(result: Result, start: float, last: float) -> float:
    """Record a chunk of tokens arriving now: the first one is the TTFT, later ones inter-token latencies."""
    now = time.perf_counter()
    if result.ttft == 0.0:
        result.ttft = now - start
    else:
        result.itl.append(now - last)
    return now


class OpenAIBackend:
    """Streaming /v1/completions (or /v1/chat/completions for messages) with aiohttp."""

    def __init__(self, base_url: str, model: str, api_key: str | None = None, timeout_s: float = 600,
                 ask_usage: bool = True):
        import aiohttp

        self.base_url, self.model, self.ask_usage = base_url.rstrip("/"), model, ask_usage
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s))

    async def send(self, req: BenchRequest) -> Result:
        body = {"model": req.model or self.model, "max_tokens": req.max_tokens, "temperature": 0, "stream": True,
                "ignore_eos": True}
        if self.ask_usage:  # else the tokens are counted from the text afterwards (stagemesh.entry.bench.counting)
            body.update(return_token_ids=True, stream_options={"include_usage": True})
        if req.messages is not None:
            url, body["messages"] = f"{self.base_url}/v1/chat/completions", req.messages
        else:
            url = f"{self.base_url}/v1/completions"
            body["prompt"] = req.prompt_ids if req.prompt_ids is not None else req.prompt
        result, start = Result(input_len=req.input_len), time.perf_counter()
        last = start
        try:
            async with self.session.post(url, json=body, headers=self.headers) as resp:
                if resp.status != 200:
                    text = await resp.text()
                    try:
                        text = json.loads(text)["error"]["message"]
                    except (ValueError, KeyError, TypeError):
                        pass
                    result.error = f"HTTP {resp.status}: {text}"
                    return result
                async for raw in resp.content:
                    line = raw.decode().strip()
                    if not line.startswith("data:") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[5:])
                    if isinstance(chunk.get("error"), dict):  # the router's mid-stream error event
                        result.error = f"stream error: {chunk['error'].get('message', chunk['error'])}"
                        return result
                    if chunk.get("usage"):
                        result.input_len = chunk["usage"]["prompt_tokens"]
                        result.output_len = chunk["usage"]["completion_tokens"]
                        result.counted_by = counting.USAGE
                    choices = chunk.get("choices") or []
                    ids = sum(len(c.get("token_ids") or []) for c in choices)
                    text = "".join(c.get("text") or (c.get("delta") or {}).get("content") or "" for c in choices)
                    result.stream_token_ids += ids
                    result.text += text
                    if ids or text:  # servers without return_token_ids (llama.cpp's): a chunk with text
                        last = _tokens_arrived(result, start, last)
            result.latency = time.perf_counter() - start
            if result.counted_by:
                result.ok = result.output_len > 0
            else:  # no usage: counted after the run, from the text (stagemesh.entry.bench.counting)
                result.ok = bool(result.stream_token_ids or result.text)
            if not result.ok:
                result.error = "the stream ended without usage or tokens"
        except Exception as err:  # noqa: BLE001 - a failed request is counted, the run goes on
            result.error = f"{type(err).__name__}: {err}"
        return result

    async def close(self) -> None:
        await self.session.close()


class GrpcBackend:
    """Streaming Generate / Chat of the router's gRPC frontend (stagemesh.v1.Frontend)."""

    def __init__(self, target: str, model: str, api_key: str | None = None, timeout_s: float = 600):
        from stagemesh.client import AsyncClient

        self.client = AsyncClient(target, model=model, timeout=timeout_s, api_key=api_key)

    async def send(self, req: BenchRequest) -> Result:
        import grpc

        result, start = Result(input_len=req.input_len), time.perf_counter()
        last = start
        try:
            if req.messages is not None:
                stream = self.client.chat(req.messages, max_tokens=req.max_tokens, ignore_eos=True, stream=True)
            else:
                prompt = req.prompt_ids if req.prompt_ids is not None else req.prompt
                stream = self.client.generate(prompt, max_tokens=req.max_tokens, ignore_eos=True, stream=True)
            async for reply in stream:
                if reply.token_ids:
                    last = _tokens_arrived(result, start, last)
                if reply.finish_reason:
                    result.input_len = reply.usage.prompt_tokens
                    result.output_len = reply.usage.completion_tokens
                    result.counted_by = counting.USAGE
            result.latency = time.perf_counter() - start
            result.ok = result.output_len > 0
            if not result.ok:
                result.error = "the stream ended without a finish reason"
        except grpc.aio.AioRpcError as err:
            result.error = f"{err.code().name}: {err.details()}"
        except Exception as err:  # noqa: BLE001 - a failed request is counted, the run goes on
            result.error = f"{type(err).__name__}: {err}"
        return result

    async def close(self) -> None:
        await self.client.channel.close()
