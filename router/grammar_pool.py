"""The router's check of a request's structured-output constraint before it goes to a replica: the server's
whitespace default filled in, then a compile in a worker process (router.grammar_process) bounded in time
(the worker is killed: --grammar-compile-timeout, 5 s by default, vLLM's regex bound) and in the compiled
grammar's size. A constraint past either bound is the client's 400; the event loop and the tokenizer's
threads never compile one. Constraints that compiled are remembered, so a repeated one costs no worker."""
from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from dataclasses import replace

from router.errors import APIError
from router.template_pool import START_TIMEOUT_S, TemplateWorker
from stagemesh.core.sampling_params import InvalidParameter, StructuredOutputs

log = logging.getLogger("stagemesh.router")
TIMEOUT_FLAG = "--grammar-compile-timeout"
MAX_GRAMMAR_BYTES = 64 << 20  # a compiled grammar (its token-mask cache) past this is refused
# the first starts with the first constraint (a worker loads the tokenizer: about 4 s of CPU and 370 MiB,
# which a router that never sees a constraint does not pay), the second once the first is busy
POOL_SIZE = 2
REMEMBERED = 1024  # constraints known to compile within the bounds
PARAM = "structured_outputs"  # router.prompts names the field the constraint came in


class GrammarChecks:
    def __init__(self, model_dir: str, timeout_s: float = 5.0, json_any_whitespace: bool = False,
                 max_bytes: int = MAX_GRAMMAR_BYTES, size: int = POOL_SIZE):
        self.model_dir, self.timeout_s, self.max_bytes, self.size = str(model_dir), timeout_s, max_bytes, size
        self.json_any_whitespace = json_any_whitespace  # the server's default (--structured-outputs-config)
        self._idle: asyncio.Queue[TemplateWorker] = asyncio.Queue()
        self._workers: set[TemplateWorker] = set()
        self._starting: set[asyncio.Task] = set()
        self._dying: set[TemplateWorker] = set()
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
        worker = await self._acquire()
        job = {"kind": s.kind, "text": s.text, "choices": list(s.choices), "any_whitespace": s.any_whitespace,
               "max_bytes": self.max_bytes}
        done = False
        try:
            reply = await asyncio.wait_for(worker.ask(job), self.timeout_s)
            done = True
        except asyncio.TimeoutError:
            log.warning("a %s constraint compiled past %s s: grammar worker %d killed", s.kind, self.timeout_s,
                        worker.proc.pid)
            raise InvalidParameter(PARAM, f"the {s.kind} constraint takes more than {self.timeout_s:g} s to compile "
                                          f"(the bound, the router's {TIMEOUT_FLAG}): stopped") from None
        except (ConnectionError, ValueError) as err:  # it died (its memory limit) or broke the protocol
            log.warning("grammar worker %d failed: %s", worker.proc.pid, err)
            raise InvalidParameter(PARAM, f"the {s.kind} constraint could not be compiled: its worker process "
                                          "stopped (a memory limit)") from None
        finally:
            if done:
                self._idle.put_nowait(worker)
            else:
                self._replace(worker)
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

    async def _acquire(self) -> TemplateWorker:
        if self._idle.empty() and len(self._workers) + len(self._starting) < self.size:
            self._spawn_later()
        getter = asyncio.ensure_future(self._idle.get())
        try:  # a worker's start (the tokenizer) may be what it waits for
            await asyncio.wait({getter}, timeout=START_TIMEOUT_S + self.timeout_s)
        except asyncio.CancelledError:  # its client left while it waited: a worker it got goes back
            if getter.done() and not getter.cancelled():
                self._idle.put_nowait(getter.result())
            getter.cancel()
            raise
        if getter.done():
            return getter.result()
        getter.cancel()
        log.warning("no grammar worker free within %s s (%d busy or starting)", START_TIMEOUT_S, self.size)
        raise APIError(503, f"all {self.size} grammar workers are busy; try again shortly", retry_after=1)

    def _replace(self, worker: TemplateWorker) -> None:
        self._workers.discard(worker)
        if worker.proc.returncode is None:
            worker.proc.kill()  # now, not when the task below runs
        self._spawn_later(worker)

    def _spawn_later(self, old: TemplateWorker | None = None) -> None:
        task = asyncio.create_task(self._respawn(old))
        self._starting.add(task)
        task.add_done_callback(self._starting.discard)

    async def _respawn(self, old: TemplateWorker | None) -> None:
        if old is not None:
            self._dying.add(old)
            await old.stop()
            self._dying.discard(old)
        try:
            worker = await TemplateWorker.start(1 << 20, "router.grammar_process", self.model_dir)
        except Exception as err:  # logged; the next check tries again (and answers 503 meanwhile)
            log.error("could not start a grammar worker: %s", err)
            return
        self._workers.add(worker)
        self._idle.put_nowait(worker)

    async def close(self) -> None:
        for task in list(self._starting):
            task.cancel()
        await asyncio.gather(*self._starting, return_exceptions=True)
        workers, self._workers = [*self._workers, *self._dying], set()
        for worker in workers:
            if worker.proc.stdin is not None:
                worker.proc.stdin.close()
        await asyncio.gather(*(w.stop() for w in workers))
