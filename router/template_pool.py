"""The router's worker processes for requests' own chat templates (--trust-request-chat-template): a few
long-lived `python -m router.template_process` children, each rendering one template at a time over JSON
lines. A render that runs past the time bound, or whose client leaves, costs its worker a SIGKILL and the
pool a new worker; the event loop and the tokenizer's threads never run a request's template."""
from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
from pathlib import Path

from router.errors import APIError, bad_request

log = logging.getLogger("stagemesh.router")
START_TIMEOUT_S = 60.0  # a worker imports transformers before it is ready
EXIT_TIMEOUT_S = 5.0
TIMEOUT_FLAG = "--chat-template-timeout"


def pool_size() -> int:
    """A small pool: two workers, one more for each further 4 cores, at most 4."""
    return min(4, max(2, (os.cpu_count() or 2) // 4))


class TemplateWorker:
    """One worker process and its two pipes."""

    def __init__(self, proc: asyncio.subprocess.Process):
        self.proc = proc

    @classmethod
    async def start(cls, max_reply_bytes: int, module: str = "router.template_process",
                    *args: str) -> "TemplateWorker":
        """`python -m module args...` (router.template_process; router.grammar_process uses it too), once it
        says it is ready."""
        root = str(Path(__file__).resolve().parents[1])  # this router's own package, wherever the cwd is
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (root, os.environ.get("PYTHONPATH")))),
               "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
        proc = await asyncio.create_subprocess_exec(sys.executable, "-m", module, *args,
                                                    stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                                                    env=env, limit=max_reply_bytes)
        worker = cls(proc)
        try:
            ready = await asyncio.wait_for(worker.read(), START_TIMEOUT_S)
        except BaseException:
            await worker.stop()
            raise
        if ready != {"ready": True}:
            await worker.stop()
            raise RuntimeError(f"{module} worker {proc.pid} did not start: {ready}")
        return worker

    async def ask(self, job: dict) -> dict:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(job).encode() + b"\n")
        await self.proc.stdin.drain()
        return await self.read()

    async def read(self) -> dict:
        assert self.proc.stdout is not None
        line = await self.proc.stdout.readline()
        if not line:
            raise ConnectionError(f"worker {self.proc.pid} exited ({await self.proc.wait()})")
        return json.loads(line)

    async def stop(self) -> None:
        """SIGKILL, then reaped (bounded: a killed process has nothing left to do)."""
        if self.proc.returncode is None:
            self.proc.kill()
        try:
            await asyncio.wait_for(self.proc.wait(), EXIT_TIMEOUT_S)
        except asyncio.TimeoutError:
            log.error("worker %d did not exit %.0f s after SIGKILL", self.proc.pid, EXIT_TIMEOUT_S)


class WorkerPool:
    """A few long-lived workers (`python -m module args...`), each doing one job at a time: a job that runs past
    its time bound, whose worker dies, or whose caller is cancelled (its client left) costs its worker a SIGKILL
    and the pool a new worker. Workers start as jobs need them, up to `size` (TemplatePool starts them all at
    once); a caller waits at most `wait_s` for one to free up, then gets a 503."""

    what = "worker"  # (log lines and the 503 name the pool's workers)

    def __init__(self, size: int, module: str, args: tuple[str, ...] = (), max_reply_bytes: int = 1 << 20,
                 wait_s: float = START_TIMEOUT_S):
        self.size, self.module, self.args, self.wait_s = size, module, args, wait_s
        self._max_reply_bytes = max_reply_bytes
        self._idle: asyncio.Queue[TemplateWorker] = asyncio.Queue()
        self._workers: set[TemplateWorker] = set()
        self._starting: set[asyncio.Task] = set()
        self._dying: set[TemplateWorker] = set()  # killed, not yet reaped

    def pids(self) -> list[int]:
        return sorted(w.proc.pid for w in self._workers)

    async def _run(self, job: dict, timeout_s: float) -> dict:
        """A worker's reply to `job`; raises asyncio.TimeoutError past `timeout_s`, ConnectionError or ValueError
        when the worker dies (a CPU or memory limit) or breaks the protocol, APIError 503 when none frees up."""
        worker = await self._acquire()
        done = False
        try:
            reply = await asyncio.wait_for(worker.ask(job), timeout_s)
            done = True
            return reply
        except asyncio.TimeoutError:
            log.warning("a job ran past %s s: %s %d killed", timeout_s, self.what, worker.proc.pid)
            raise
        except asyncio.CancelledError:
            log.info("a job's client left: %s %d killed", self.what, worker.proc.pid)
            raise
        except (ConnectionError, ValueError) as err:
            log.warning("%s %d failed: %s", self.what, worker.proc.pid, err)
            raise
        finally:
            if done:
                self._idle.put_nowait(worker)
            else:  # timed out, died, or its client left (cancelled): the job is stopped with its process
                self._replace(worker)

    async def _acquire(self) -> TemplateWorker:
        if self._idle.empty() and len(self._workers) + len(self._starting) < self.size:
            self._spawn_later()  # (the first jobs, or a start that failed before)
        getter = asyncio.ensure_future(self._idle.get())
        try:
            await asyncio.wait({getter}, timeout=self.wait_s)
        except asyncio.CancelledError:  # its client left while it waited: a worker it got goes back
            if getter.done() and not getter.cancelled():
                self._idle.put_nowait(getter.result())
            getter.cancel()
            raise
        if getter.done():
            return getter.result()
        getter.cancel()
        log.warning("no %s free within %s s (%d busy or starting)", self.what, self.wait_s, self.size)
        raise APIError(503, f"all {self.size} {self.what}s are busy; try again shortly", retry_after=1)

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
            await self._spawn()
        except Exception as err:  # logged; the next job tries again (and answers 503 meanwhile)
            log.error("could not start a %s: %s", self.what, err)

    async def _spawn(self) -> None:
        worker = await TemplateWorker.start(self._max_reply_bytes, self.module, *self.args)
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


class TemplatePool(WorkerPool):
    """Renders a request's chat template in a worker, within `timeout_s` (and the time to get a worker)."""

    what = "chat template worker"

    def __init__(self, timeout_s: float, max_chars: int, size: int | None = None):
        # a reply is JSON text of at most max_chars characters, each at most 12 bytes escaped
        super().__init__(size or pool_size(), "router.template_process", max_reply_bytes=12 * max_chars + 2**20,
                         wait_s=timeout_s)
        self.timeout_s, self.max_chars = timeout_s, max_chars

    async def start(self) -> None:
        await asyncio.gather(*(self._spawn() for _ in range(self.size)))
        log.info("%d chat template worker(s) for requests' own templates (pids %s; %s s each)", self.size,
                 ", ".join(str(p) for p in self.pids()), self.timeout_s)

    async def render(self, job: dict) -> str:
        """The rendered text; 400 naming chat_template past the time bound or the size bound, 503 when no
        worker frees up in time. A caller that is cancelled (its client left) kills the worker."""
        job = {**job, "max_chars": self.max_chars, "cpu_seconds": 2 * self.timeout_s}
        try:
            reply = await self._run(job, self.timeout_s)
        except asyncio.TimeoutError:
            raise bad_request(f"'chat_template' took more than {self.timeout_s:g} s to render (the router's "
                              f"{TIMEOUT_FLAG}): stopped", "chat_template") from None
        except (ConnectionError, ValueError):
            raise bad_request("'chat_template' could not be rendered: its worker process stopped (a CPU or memory "
                              "limit)", "chat_template") from None
        return _text(reply, self.max_chars)


def _text(reply: dict, max_chars: int) -> str:
    error = reply.get("error")
    if error is None:
        return reply["text"]
    if error == "too_long":
        raise bad_request(f"'chat_template' wrote more than {max_chars:,} characters: more than any prompt this "
                          "model can take; stopped", "chat_template")
    if error == "memory":
        raise bad_request(f"'chat_template' could not be rendered: {reply['message']} of memory", "chat_template")
    raise bad_request(f"the chat template could not render these messages: {reply['message']}", "messages")
