"""vLLM's run-time LoRA endpoints, served when VLLM_ALLOW_RUNTIME_LORA_UPDATING is true (as vLLM does), behind
the API key like every other endpoint: POST /v1/load_lora_adapter {"lora_name", "lora_path"} and POST
/v1/unload_lora_adapter {"lora_name"}.

A load goes to every replica (each scheduler checks the path against --allowed-local-lora-path, then every stage
reads the weights before a request may use them); a replica that refuses undoes the replicas before it, and the
client gets the reason. A replica that cannot be reached now gets the adapter once it answers again (sync). An
unload takes the adapter out of this router's model list at once, then waits (at most UNLOAD_WAIT_S) for each
replica's requests that use it to finish before the replica forgets it.
"""
from __future__ import annotations

import asyncio
import logging
import os

import grpc
from aiohttp import web

from router.errors import APIError, bad_request
from router.http_body import read_json
from router.state import CONFIG
from stagemesh.core.lora import LoRAError, check_adapter_name

log = logging.getLogger("stagemesh.router")
RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
UNLOAD_WAIT_S = 60.0
UNLOAD_RETRY_S = 0.5
# a gRPC refusal as vLLM's HTTP status
_HTTP = {grpc.StatusCode.NOT_FOUND: 404, grpc.StatusCode.UNAVAILABLE: 503, grpc.StatusCode.DEADLINE_EXCEEDED: 503}


def enabled() -> bool:
    return os.environ.get(RUNTIME_LORA_ENV, "").lower() in ("1", "true")


def add_routes(app: web.Application) -> None:
    if enabled():
        app.router.add_post("/v1/load_lora_adapter", load_lora_adapter)
        app.router.add_post("/v1/unload_lora_adapter", unload_lora_adapter)


async def _body(request: web.Request, fields: tuple[str, ...], optional: tuple[str, ...] = ()) -> dict:
    body = await read_json(request)
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    for key in body:
        if key not in fields and key not in optional:
            raise bad_request(f"{key} is not a field of {request.path}", key)
    for key in fields:
        if not isinstance(body.get(key), str) or not body[key]:
            raise bad_request(f"{key} (a string) is required", key)
    try:
        check_adapter_name(body["lora_name"])
    except LoRAError as err:
        raise bad_request(str(err), "lora_name") from None
    return body


def _registry(request: web.Request):
    config = request.app[CONFIG]
    if not config.lora.enabled:
        raise bad_request(f"{request.path}: this server runs without --enable-lora", "lora_name")
    return config, config.lora


async def load_lora_adapter(request: web.Request) -> web.Response:
    config, registry = _registry(request)
    body = await _body(request, ("lora_name", "lora_path"), ("load_inplace",))
    name, path = body["lora_name"], body["lora_path"]
    if body.get("load_inplace"):
        raise bad_request("load_inplace (replacing a loaded adapter's weights) is not supported: unload it first",
                          "load_inplace")
    if name == config.served_model_name or name in registry.names():
        raise bad_request(f"The lora adapter '{name}' has already been loaded.", "lora_name")
    try:
        registry.check_path(name, path)
    except LoRAError as err:
        raise bad_request(str(err), "lora_path") from None
    async with registry.lock:
        await load_everywhere(registry, name, path)
        registry.loaded[name] = path
        registry.unloaded.discard(name)
    log.info("LoRA adapter %r loaded at run time from %s", name, path)
    return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")


async def load_everywhere(registry, name: str, path: str) -> None:
    """Every replica that answers reads the adapter, or none keeps it (APIError with the first refusal)."""
    replicas = [r for r in registry.replica_set.replicas if not r.forgotten]
    results = await asyncio.gather(*(r.load_lora(name, path) for r in replicas), return_exceptions=True)
    done = [r for r, res in zip(replicas, results) if not isinstance(res, BaseException)]
    failed = [(r, res) for r, res in zip(replicas, results) if isinstance(res, grpc.aio.AioRpcError)
              and res.code() != grpc.StatusCode.UNAVAILABLE]
    other = next((res for res in results if isinstance(res, BaseException)
                  and not isinstance(res, grpc.aio.AioRpcError)), None)
    if other is not None:  # (not a refusal: still, no replica keeps what it loaded)
        await asyncio.gather(*(_unload(r, name) for r in done))
        raise other
    if failed or not done:
        await asyncio.gather(*(_unload(r, name) for r in done))
        if not failed:
            raise APIError(503, f"LoRA adapter {name!r}: no replica could be reached to load it")
        replica, err = failed[0]
        raise APIError(_HTTP.get(err.code(), 400), f"{err.details()} (replica {replica.address})", "lora_path")
    for r in replicas:
        if r in done:
            r.lora_adapters[name] = path  # (its next stats say so too)
        else:
            log.warning("LoRA adapter %r: replica %s could not be reached; it gets the adapter once it answers",
                        name, r.address)


async def unload_lora_adapter(request: web.Request) -> web.Response:
    _, registry = _registry(request)
    body = await _body(request, ("lora_name",), ("lora_int_id",))
    if "lora_int_id" in body:  # (vLLM's optional id; stagemesh's adapters have names only)
        raise bad_request("lora_int_id is not supported: adapters are unloaded by lora_name", "lora_int_id")
    name = body["lora_name"]
    if name not in registry.names():
        raise APIError(404, f"The lora adapter '{name}' cannot be found.", "lora_name")
    async with registry.lock:
        registry.unloading.add(name)  # no new request takes it from here on
        try:
            await asyncio.gather(*(_unload_when_unused(r, name) for r in registry.replica_set.replicas))
            registry.loaded.pop(name, None)
            registry.unloaded.add(name)
        finally:
            registry.unloading.discard(name)
    log.info("LoRA adapter %r unloaded", name)
    return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")


async def _unload_when_unused(replica, name: str) -> None:
    """The replica forgets the adapter once no request of its uses it (at most UNLOAD_WAIT_S)."""
    deadline = asyncio.get_running_loop().time() + UNLOAD_WAIT_S
    waiting = False
    while True:
        try:
            await replica.unload_lora(name)
            replica.lora_adapters.pop(name, None)  # (its next stats say so too)
            return
        except grpc.aio.AioRpcError as err:
            if err.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAVAILABLE):
                replica.lora_adapters.pop(name, None)
                return  # it never had it, or it is gone (a restarted scheduler starts without it)
            if err.code() != grpc.StatusCode.FAILED_PRECONDITION:
                raise APIError(_HTTP.get(err.code(), 400), f"{err.details()} (replica {replica.address})",
                               "lora_name") from None
            if asyncio.get_running_loop().time() > deadline:
                raise APIError(400, f"{err.details()}: still so after {UNLOAD_WAIT_S:.0f}s (replica "
                                    f"{replica.address}); no new request takes it, try again", "lora_name") from None
            if not waiting:
                waiting = True
                log.info("LoRA adapter %r: waiting (at most %.0fs) for replica %s's requests that use it to finish",
                         name, UNLOAD_WAIT_S, replica.address)
            await asyncio.sleep(UNLOAD_RETRY_S)


async def _unload(replica, name: str) -> None:
    try:
        await replica.unload_lora(name)
    except grpc.aio.AioRpcError as err:
        log.warning("LoRA adapter %r: undoing its load on %s: %s", name, replica.address, err.details())


def sync_soon(registry) -> None:
    """Start a sync (below) unless one runs."""
    if registry.enabled and (registry.loaded or registry.unloaded) and \
            (registry.sync_task is None or registry.sync_task.done()):
        registry.sync_task = asyncio.create_task(sync(registry))


async def sync(registry) -> None:
    """A restarted scheduler starts with its --lora-modules: a replica that lacks an adapter this router loaded
    gets it, and one that serves an adapter this router unloaded forgets it (once no request uses it)."""
    if registry.lock.locked():
        return
    async with registry.lock:
        for replica in registry.replica_set.replicas:
            if not replica.healthy or not replica.lora_reported:
                continue
            for name in registry.unloaded & set(replica.lora_adapters):
                try:
                    await replica.unload_lora(name)
                    replica.lora_adapters.pop(name, None)
                    log.info("LoRA adapter %r unloaded from replica %s, which served it again", name,
                             replica.address)
                except grpc.aio.AioRpcError as err:  # (in use: the next round tries again)
                    log.info("LoRA adapter %r: replica %s serves it again; unloading: %s", name, replica.address,
                             err.details())
            for name, path in list(registry.loaded.items()):
                if name in replica.lora_adapters:
                    continue
                try:
                    await replica.load_lora(name, path)
                    replica.lora_adapters[name] = path
                    log.info("LoRA adapter %r loaded on replica %s, which lacked it", name, replica.address)
                except grpc.aio.AioRpcError as err:
                    log.warning("LoRA adapter %r: replica %s lacks it and could not load it: %s", name,
                                replica.address, err.details())
