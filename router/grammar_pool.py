"""The router's check of a request's structured-output constraint before it goes to a replica: the server's
whitespace default filled in, then a compile in a worker process (router.grammar_process) bounded in time
(the worker is killed: --grammar-compile-timeout, 5 s by default, vLLM's regex bound) and in the compiled
grammar's size. A constraint past either bound is the client's 400; the event loop and the tokenizer's
threads never compile one. Constraints that compiled are remembered, so a repeated one costs no worker."""
from __future__ import annotations

import asyncio
from collections import OrderedDict
from dataclasses import replace

from router.template_pool import START_TIMEOUT_S, WorkerPool
from stagemesh.core.sampling_params import InvalidParameter, StructuredOutputs

TIMEOUT_FLAG = "--grammar-compile-timeout"
MAX_GRAMMAR_BYTES = 64 << 20  # a compiled grammar (its token-mask cache) past this is refused
# the first starts with the first constraint (a worker loads the tokenizer: about 4 s of CPU and 370 MiB,
# which a router that never sees a constraint does not pay), the second once the first is busy
POOL_SIZE = 2
REMEMBERED = 1024  # constraints known to compile within the bounds
PARAM = "structured_outputs"  # router.prompts names the field the constraint came in


class GrammarChecks(WorkerPool):
    what = "grammar worker"

    def __init__(self, model_dir: str, timeout_s: float = 5.0, json_any_whitespace: bool = False,
                 max_bytes: int = MAX_GRAMMAR_BYTES, size: int = POOL_SIZE):
        # a caller may wait for a worker's start (the tokenizer) and then its compile
        super().__init__(size, "router.grammar_process", (str(model_dir),), wait_s=START_TIMEOUT_S + timeout_s)
        self.timeout_s, self.max_bytes = timeout_s, max_bytes
        self.json_any_whitespace = json_any_whitespace  # the server's default (--structured-outputs-config)
        self._compiled: OrderedDict[tuple, None] = OrderedDict()

    def resolve(self, s: StructuredOutputs) -> StructuredOutputs:
        """`s` with the server's whitespace default where the request left it open (JSON kinds only)."""
        if s.any_whitespace is None and s.kind in ("json", "json_object"):
            return replace(s, any_whitespace=self.json_any_whitespace)
        return s

    async def check(self, s: StructuredOutputs) -> None:
        """Returns once `s` compiles within the bounds; raises InvalidParameter (structured_outputs) saying
        why not, APIError 503 when no worker frees up in time. A caller cancelled (its client left) kills the
        worker it used."""
        if s.key in self._compiled:
            self._compiled.move_to_end(s.key)
            return
        job = {"kind": s.kind, "text": s.text, "choices": list(s.choices), "any_whitespace": s.any_whitespace,
               "max_bytes": self.max_bytes}
        try:
            reply = await self._run(job, self.timeout_s)
        except asyncio.TimeoutError:
            raise InvalidParameter(PARAM, f"the {s.kind} constraint takes more than {self.timeout_s:g} s to compile "
                                          f"(the bound, the router's {TIMEOUT_FLAG}): stopped") from None
        except (ConnectionError, ValueError):  # it died (its memory limit) or broke the protocol
            raise InvalidParameter(PARAM, f"the {s.kind} constraint could not be compiled: its worker process "
                                          "stopped (a memory limit)") from None
        self._read(reply, s)
        self._compiled[s.key] = None
        while len(self._compiled) > REMEMBERED:
            self._compiled.popitem(last=False)

    def _read(self, reply: dict, s: StructuredOutputs) -> None:
        error = reply.get("error")
        if error == "too_big":
            raise InvalidParameter(PARAM, f"the {s.kind} constraint compiles to {int(reply['message']) / 2**20:.0f} "
                                          f"MiB, more than the bound of {self.max_bytes >> 20} MiB")
        if error == "memory":
            raise InvalidParameter(PARAM, f"the {s.kind} constraint needs more memory to compile than a worker has")
        if error is not None:
            raise InvalidParameter(PARAM, reply["message"])
