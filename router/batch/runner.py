"""Running batches: each input line sent to this router's own endpoint (so it gets exactly a direct call's answer,
or its error), a few at a time, at a lower priority than interactive requests where the replicas schedule by
priority; each result appended to the batch's progress file as it comes; at the end the output and error files
(input order). One router runs a batch at a time (an flock on its lock file, which the kernel drops when that
router dies), and every router looks for batches nobody runs every SCAN_S: a batch goes on after a restart, or
on another router after its own died, from the lines its progress file lacks. A cancel (a flag file) stops lines
from starting; those running finish."""
from __future__ import annotations

import asyncio
import fcntl
import logging
import secrets
from pathlib import Path

import aiohttp

from router.batch.state import (ACTIVE, BATCH_PRIORITY, TENANT_FIELD, BatchState, error_record, load_lines,
                                parse_line, result_record)
from router.batch.files import FileStore
from router.state import BATCH_TENANT_HEADER

log = logging.getLogger("stagemesh.router")
SCAN_S = 2.0
RETRY_S = 1.0  # a line the replicas could not take now (503, 429) is sent again after this
MAX_TRIES = 60  # ... at most this many times, then it is an error line


class BatchRunner:
    def __init__(self, root: Path, files: FileStore, concurrency: int, replicas, keyed: bool):
        self.root, self.files, self.concurrency = root, files, concurrency
        self.replicas, self.keyed = replicas, keyed  # keyed: the router takes keys (tenants)
        # this process's own credential for its lines (router.app's middleware takes it with the tenant's name):
        # no tenant's key is kept, on disk or here
        self.credential = secrets.token_urlsafe(32)
        self.base_url: str | None = None  # this router's own HTTP address, once it listens
        self.running: dict[str, asyncio.Task] = {}
        self._scan: asyncio.Task | None = None

    def serve(self, base_url: str) -> None:
        """Start looking for batches to run, sending their lines to `base_url`."""
        self.base_url = base_url
        self._scan = asyncio.create_task(self._scan_loop())

    async def close(self) -> None:
        for task in [*self.running.values(), *([self._scan] if self._scan else [])]:
            task.cancel()
        await asyncio.gather(*self.running.values(), return_exceptions=True)

    def poke(self) -> None:
        """A batch was made: take it now rather than at the next scan."""
        if self.base_url is not None:
            self._take_free()

    async def _scan_loop(self) -> None:
        while True:
            self._take_free()
            await asyncio.sleep(SCAN_S)

    def _take_free(self) -> None:
        for state in BatchState.all(self.root):
            if state.body["status"] in ACTIVE and state.id not in self.running:
                lock = _try_lock(state.lock_path)
                if lock is not None:
                    task = asyncio.create_task(self._run(state.id, lock))
                    self.running[state.id] = task
                    task.add_done_callback(self._forget(state.id))

    def _forget(self, batch_id: str):
        def done(_: asyncio.Task) -> None:
            self.running.pop(batch_id, None)
        return done

    async def _run(self, batch_id: str, lock) -> None:
        try:
            state = BatchState.read(self.root, batch_id)  # (again, under the lock)
            if state.body["status"] not in ACTIVE:
                return
            lines = load_lines(self.files.path(state.body["input_file_id"]))
            state.start(len(lines))
            done = state.done_indices()
            log.info("batch %s: %d of %d lines to run", batch_id, len(lines) - len(done), len(lines))
            await self._lines(state, lines, done)
            state.finish(self.files, len(lines))
            log.info("batch %s %s: %s", batch_id, state.body["status"], state.body["request_counts"])
        except asyncio.CancelledError:
            raise
        except Exception as err:  # (a bug, or its files gone): the batch fails saying why, never hangs
            log.exception("batch %s failed", batch_id)
            BatchState.read(self.root, batch_id).fail(f"{type(err).__name__}: {err}")
        finally:
            lock.close()

    async def _lines(self, state: BatchState, lines: list[str], done: set[int]) -> None:
        gate = asyncio.Semaphore(self.concurrency)
        seen: set[str] = set()
        tasks = []
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            for index, line in enumerate(lines):
                request, error = parse_line(line, state.body["endpoint"], seen)
                if index in done:
                    continue
                if state.cancel_requested():
                    break
                if error is not None:
                    state.record(index, False, error_record(state.id, index, error))
                    continue
                assert request is not None
                await gate.acquire()
                tasks.append(asyncio.create_task(self._send(session, state, index, request, gate)))
            await asyncio.gather(*tasks)

    async def _send(self, session: aiohttp.ClientSession, state: BatchState, index: int, request: dict,
                    gate: asyncio.Semaphore) -> None:
        try:
            body = dict(request["body"])
            if "priority" not in body and self.replicas.scheduling_policies == {"priority"}:
                body["priority"] = BATCH_PRIORITY  # below interactive requests (vLLM's: larger is later)
            headers = self._headers(state)
            for attempt in range(MAX_TRIES):
                async with session.post(f"{self.base_url}{state.body['endpoint']}", json=body, headers=headers) as r:
                    status, payload, rid = r.status, await _json(r), r.headers.get("X-Request-Id", "")
                if status not in (429, 503) or attempt == MAX_TRIES - 1:
                    break
                await asyncio.sleep(RETRY_S)
            state.record(index, status == 200, result_record(state.id, index, request["custom_id"], status, rid,
                                                             payload))
        except aiohttp.ClientError as err:  # (this router itself went away: the line runs again on resume)
            log.warning("batch %s line %d: %s (it runs again when the batch is taken up)", state.id, index, err)
        finally:
            gate.release()

    def _headers(self, state: BatchState) -> dict[str, str]:
        """Each line runs as a request of the tenant that created its batch: counted against that tenant's
        limits and scheduled by its weight, as any of its requests."""
        if not self.keyed:
            return {}
        return {"Authorization": f"Bearer {self.credential}", BATCH_TENANT_HEADER: state.body.get(TENANT_FIELD, "")}


async def _json(response: aiohttp.ClientResponse):
    try:
        return await response.json(content_type=None)
    except ValueError:
        return {"error": {"message": (await response.text())[:1000], "code": response.status}}


def _try_lock(path: Path):
    """The batch's lock file, held open and locked (None: another router runs it)."""
    handle = open(path, "a")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        return None
    return handle

