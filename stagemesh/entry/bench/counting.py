"""Token counts of streams that brought no usage (llama-cpp-python's server sends none in a stream): after the
timed run, each request's prompt and the text it got back are tokenized again, by the server's tokenize
endpoint (vLLM's and stagemesh's `POST /tokenize`, llama-cpp-python's `POST /extras/tokenize`) or, where the
server has none, by the local tokenizer (--model-path / the embedded model). A completion's text tokenized on
its own may differ by a token or so from what the server generated; a count that cannot be made is an error,
never a 0."""
from __future__ import annotations

import asyncio
import json
from typing import Any, Callable

from stagemesh.entry.bench.report import Result
from stagemesh.entry.bench.workload import BenchRequest
from stagemesh.core.errors import StagemeshError

USAGE = "usage (the server's)"
STREAM_IDS = "token ids in the stream (completion), the prompt's own ids"
LOCAL = "local tokenizer"


class TokenCounter:
    """Counts prompt and completion tokens of finished requests; `way` says how (for the summary)."""

    def __init__(self, session, base_url: str, model: str, headers: dict, mode: str,
                 local_tokenizer: Callable[[], object], local_name: str):
        self.session, self.base_url, self.model, self.headers = session, base_url.rstrip("/"), model, headers
        self.mode, self._load_local, self.local_name = mode, local_tokenizer, local_name
        self._endpoint: str | None = None  # "/tokenize" or "/extras/tokenize" once probed
        self._probed = False
        self._local: Any = None  # the local tokenizer, once loaded (local_tokenizer's: any transformers one)
        self._special = 0  # tokens /extras/tokenize adds to any text (BOS): not part of a completion

    async def fill(self, results: list[Result], requests: list[BenchRequest]) -> None:
        """Set input_len / output_len / counted_by of each successful result that has no counts yet."""
        todo = [(r, q) for r, q in zip(results, requests) if r.ok and not r.counted_by]
        if not todo:
            return
        if self.mode in ("auto", "server") and not self._probed:
            await self._probe()
        if self.mode == "server" and self._endpoint is None:
            raise StagemeshError(f"--count-tokens server: {self.base_url} has no tokenize endpoint "
                                 "(POST /tokenize or /extras/tokenize answered no token list)")
        limit = asyncio.Semaphore(8)

        async def one(r: Result, q: BenchRequest) -> None:
            async with limit:
                await self._count(r, q)

        await asyncio.gather(*(one(r, q) for r, q in todo))

    async def _count(self, r: Result, q: BenchRequest) -> None:
        ways = set()
        if self.mode == "auto" and r.stream_token_ids:
            r.output_len = r.stream_token_ids
        else:
            r.output_len, way = await self._tokens(r.text, completion=True)
            ways.add(way)
        if q.prompt_ids is not None:
            r.input_len = len(q.prompt_ids)
        elif q.messages is not None:
            r.input_len, way = await self._chat_tokens(q.messages)
            ways.add(way)
        else:
            r.input_len, way = await self._tokens(q.prompt or "", completion=False)
            ways.add(way)
        r.counted_by = " + ".join(sorted(ways)) if ways else STREAM_IDS
        if r.output_len < 1:
            r.ok, r.error = False, f"tokens arrived but their text counts {r.output_len} tokens ({r.counted_by})"

    async def _probe(self) -> None:
        self._probed = True
        for path, body in (("/tokenize", {"model": self.model, "prompt": "hello"}),
                           ("/extras/tokenize", {"model": self.model, "input": "hello"})):
            try:
                await self._post(path, body)
            except (StagemeshError, OSError, asyncio.TimeoutError):
                continue
            self._endpoint = path
            if path == "/extras/tokenize":  # no add_special_tokens there: what it adds to "" is not the text's
                self._special = len(await self._post(path, {"model": self.model, "input": ""}))
            return

    async def _post(self, path: str, body: dict) -> list[int]:
        import aiohttp

        try:
            async with self.session.post(f"{self.base_url}{path}", json=body, headers=self.headers) as resp:
                text = await resp.text()
                if resp.status != 200:
                    raise StagemeshError(f"POST {self.base_url}{path} answered HTTP {resp.status}: {text[:300]}")
        except aiohttp.ClientError as err:
            raise StagemeshError(f"POST {self.base_url}{path}: {type(err).__name__}: {err}") from None
        try:
            tokens = json.loads(text)["tokens"]
        except (ValueError, KeyError, TypeError):
            tokens = None
        if not isinstance(tokens, list):
            raise StagemeshError(f"POST {self.base_url}{path} answered no token list: {text[:300]}")
        return tokens

    def _local_tokenizer(self):
        if self._local is None:
            try:
                self._local = self._load_local()
            except Exception as err:  # noqa: BLE001 - any failure to load is the same error for the user
                raise StagemeshError(
                    f"the streams brought no usage and {self.base_url} has no tokenize endpoint (POST /tokenize "
                    f"or /extras/tokenize), and the local tokenizer ({self.local_name}) does not load: "
                    f"{type(err).__name__}: {err}; cannot count the tokens (pass --model-path with the served "
                    "model's tokenizer)") from None
        return self._local

    async def _tokens(self, text: str, completion: bool) -> tuple[int, str]:
        if self.mode != "local" and self._endpoint == "/tokenize":
            body: dict[str, object] = {"model": self.model, "prompt": text}
            if completion:
                body["add_special_tokens"] = False
            return len(await self._post("/tokenize", body)), "server POST /tokenize"
        if self.mode != "local" and self._endpoint == "/extras/tokenize":
            n = len(await self._post("/extras/tokenize", {"model": self.model, "input": text}))
            return (n - self._special if completion else n), "server POST /extras/tokenize"
        tok = self._local_tokenizer()
        return len(tok.encode(text, add_special_tokens=not completion)), f"{LOCAL} ({self.local_name})"

    async def _chat_tokens(self, messages: list[dict]) -> tuple[int, str]:
        if self.mode != "local" and self._endpoint == "/tokenize":
            body = {"model": self.model, "messages": messages, "add_generation_prompt": True}
            return len(await self._post("/tokenize", body)), "server POST /tokenize"
        tok = self._local_tokenizer()  # /extras/tokenize takes text only, not messages
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
            ids = ids["input_ids"]
        return len(ids), f"{LOCAL} ({self.local_name})"
