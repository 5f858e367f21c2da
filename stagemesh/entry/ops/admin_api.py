"""serve's admin HTTP API (aiohttp, on a thread of its own; loopback unless --admin-host says otherwise):

    GET  /admin/status    the mesh, the running (and the last) operation, the autoscaler
    POST /admin/rollout   {"surge": false}: a rolling restart of every service (202; 409 while one runs)
    POST /admin/scale     {"data_parallel_size": N}: add or remove replicas (202; 200 when it has N; 409 busy)
    POST /admin/reload-api-keys   every router reads its --api-keys-file again, as on serve's SIGHUP (200;
                          400 when a router could not: its tenants stay as they were, the answer says why)

Every call needs 'Authorization: Bearer <admin key>': none gives 401, another key 403. A refused operation
answers 400 (a size or layout the mesh cannot have, or no room for it), 409 (another operation runs) or 503
(serve stops). Every error is the gateway's JSON ({"error": {"message", "type", "param", "code"}}, router.errors),
those aiohttp answers itself too: an unknown path (404), a wrong method (405), a body past its bound (413) and
a request its HTTP parser refuses (400, 414, 431: router.http_server)."""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import threading
from typing import Protocol

from aiohttp import web

from router.errors import APIError
from router.http_server import GatewayRunner
from stagemesh.core.errors import StagemeshError
from stagemesh.entry.ops.operation import Refused

log = logging.getLogger("stagemesh.serve")
START_TIMEOUT_S = 10.0
MAX_BODY_BYTES = 4096


class Controller(Protocol):
    def status(self) -> dict: ...
    def rollout(self, surge: bool) -> dict: ...
    def scale(self, n: int) -> dict | None: ...
    def reload_api_keys(self) -> dict: ...


def _error(status: int, message: str) -> web.Response:
    resp = APIError(status, message).response()
    if status == 401:
        resp.headers["WWW-Authenticate"] = "Bearer"
    return resp


def build_app(controller: Controller, key: str) -> web.Application:
    @web.middleware
    async def auth(request: web.Request, handler):
        given = request.headers.get("Authorization", "")
        if not given:
            return _error(401, "the admin API needs 'Authorization: Bearer <admin key>'")
        if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
            return _error(403, "wrong admin key")
        try:
            return await handler(request)
        except Refused as err:
            return _error(err.status, str(err))
        except StagemeshError as err:
            return _error(400, str(err))
        except web.HTTPException as err:  # aiohttp's own: 404, 405, 413 (a body past its bound)
            if err.status < 400:
                raise
            path = request.path[:200]
            known = {404: f"no route {request.method} {path}", 405: f"{request.method} is not allowed on {path}"}
            return _error(err.status, known.get(err.status, err.text or err.reason))

    async def status(request: web.Request) -> web.Response:
        return web.json_response(controller.status())

    async def rollout(request: web.Request) -> web.Response:
        body = await _body(request)
        surge = body.get("surge", False)
        if not isinstance(surge, bool):
            raise Refused(400, "'surge' must be true or false")
        return web.json_response({"operation": controller.rollout(surge)}, status=202)

    async def scale(request: web.Request) -> web.Response:
        n = (await _body(request)).get("data_parallel_size")
        if not isinstance(n, int) or isinstance(n, bool):
            raise Refused(400, "'data_parallel_size' (an integer) is required")
        op = controller.scale(n)
        return web.json_response({"operation": op}, status=200 if op is None else 202)

    async def reload_api_keys(request: web.Request) -> web.Response:
        answer = await asyncio.to_thread(controller.reload_api_keys)
        failed = [r for r in answer["routers"] if not r["reloaded"]]
        if failed:
            return _error(400, "; ".join(f"{r['router']}: {r['error']}" for r in failed))
        return web.json_response(answer)

    app = web.Application(middlewares=[auth], client_max_size=MAX_BODY_BYTES)
    app.router.add_get("/admin/status", status)
    app.router.add_post("/admin/rollout", rollout)
    app.router.add_post("/admin/scale", scale)
    app.router.add_post("/admin/reload-api-keys", reload_api_keys)
    return app


async def _body(request: web.Request) -> dict:
    if not request.can_read_body:
        return {}
    try:
        body = json.loads(await request.text())
    except ValueError:
        raise Refused(400, "the body must be a JSON object") from None
    if not isinstance(body, dict):
        raise Refused(400, "the body must be a JSON object")
    return body


class AdminServer:
    """The admin API on a thread and event loop of its own."""

    def __init__(self, controller: Controller, key: str, host: str, port: int):
        self.app, self.host, self.port = build_app(controller, key), host, port
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._started = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._serve, name="admin-api", daemon=True)

    def start(self) -> int:
        """Listen; the bound port. StagemeshError when it cannot."""
        self._thread.start()
        if not self._started.wait(START_TIMEOUT_S):
            raise StagemeshError(f"the admin API did not start within {START_TIMEOUT_S:.0f}s")
        if self._error is not None:
            raise StagemeshError(f"--admin-port {self.port}: cannot listen on {self.host}: {self._error}")
        return self.port

    def _serve(self) -> None:
        self._loop = asyncio.new_event_loop()
        try:
            self._loop.run_until_complete(self._listen())
        except OSError as err:
            self._error = err
            self._started.set()
            self._loop.close()
            return
        self._started.set()
        try:
            self._loop.run_forever()
        finally:  # (a loop left open is closed by the garbage collector at exit, after its selector: a traceback)
            self._loop.close()

    async def _listen(self) -> None:
        self._runner = GatewayRunner(self.app, access_log=None)  # (what its HTTP parser refuses, in JSON too)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = self._runner.addresses[0][1]

    def stop(self) -> None:
        loop, runner = self._loop, self._runner
        if loop is None or runner is None or not loop.is_running():
            return
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(timeout=5)
        loop.call_soon_threadsafe(loop.stop)
        self._thread.join(timeout=5)
