"""The Batch API online, in OpenAI's shapes: /v1/files (upload with purpose "batch", list, retrieve, content,
delete) and /v1/batches (create, retrieve, list, cancel), kept under --batch-dir (router.batch.files,
router.batch.state) and run by this router's BatchRunner (router.batch.runner)."""
from __future__ import annotations

from aiohttp import BodyPartReader, web

from router.batch.files import FileStore
from router.batch.runner import BatchRunner
from router.batch.state import COMPLETION_WINDOW, ENDPOINTS, BatchState
from router.errors import APIError, bad_request
from router.http_body import read_json
from router.state import TENANT

FILES = web.AppKey("batch_files", FileStore)
# (with tenants, each call sees only its tenant's files and batches: router.batch.files)
RUNNER = web.AppKey("batch_runner", BatchRunner)
MAX_LIST = 10_000


def add_routes(app: web.Application, files: FileStore, runner: BatchRunner) -> None:
    app[FILES], app[RUNNER] = files, runner
    app.router.add_post("/v1/files", upload)
    app.router.add_get("/v1/files", list_files)
    app.router.add_get("/v1/files/{file_id}", retrieve_file)
    app.router.add_get("/v1/files/{file_id}/content", file_content)
    app.router.add_delete("/v1/files/{file_id}", delete_file)
    app.router.add_post("/v1/batches", create_batch)
    app.router.add_get("/v1/batches", list_batches)
    app.router.add_get("/v1/batches/{batch_id}", retrieve_batch)
    app.router.add_post("/v1/batches/{batch_id}/cancel", cancel_batch)
    app.on_cleanup.append(lambda _: runner.close())


async def upload(request: web.Request) -> web.Response:
    """multipart/form-data with `purpose` and `file`, as the openai client sends them (purpose first)."""
    if not request.content_type.startswith("multipart/"):
        raise bad_request("upload a file as multipart/form-data with 'file' and 'purpose'", "file")
    reader = await request.multipart()
    purpose, meta = None, None
    while (part := await reader.next()) is not None:
        if not isinstance(part, BodyPartReader):  # (a nested multipart: not a form field)
            raise bad_request("the upload must be a flat multipart form", "file")
        if part.name == "purpose":
            purpose = (await part.read(decode=True)).decode(errors="replace")[:64]
        elif part.name == "file":
            if purpose != "batch":
                raise bad_request(f"'purpose' must be 'batch' (sent before the file), got {purpose!r}: this server "
                                  "keeps files for batches only", "purpose")
            meta = await request.app[FILES].upload(_chunks(part), part.filename or "upload.jsonl", purpose,
                                                   _owner(request))
    if meta is None:
        raise bad_request("'file' is required", "file")
    return web.json_response(meta)


def _owner(request: web.Request) -> str | None:
    """The tenant of the key the call presented (None without tenants)."""
    tenant = request.get(TENANT)
    return tenant.name if tenant is not None else None


async def _chunks(part):
    while chunk := await part.read_chunk(1 << 16):
        yield chunk


def _page(items: list[dict], request: web.Request) -> dict:
    """OpenAI's list: `after` an id, `limit` items (default 20; files: 10,000), `order` desc (files: asc too)."""
    query = request.query
    after, order = query.get("after"), query.get("order", "desc")
    try:
        limit = int(query.get("limit", "20"))
    except ValueError:
        raise bad_request("'limit' must be an integer", "limit") from None
    if not 1 <= limit <= MAX_LIST or order not in ("asc", "desc"):
        raise bad_request(f"'limit' must be in [1, {MAX_LIST}] and 'order' asc or desc", "limit")
    if order == "asc":
        items = items[::-1]
    if after is not None:
        ids = [i["id"] for i in items]
        items = items[ids.index(after) + 1:] if after in ids else []
    page = items[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}


async def list_files(request: web.Request) -> web.Response:
    return web.json_response(_page(request.app[FILES].list(request.query.get("purpose"), _owner(request)), request))


async def retrieve_file(request: web.Request) -> web.Response:
    return web.json_response(request.app[FILES].get(request.match_info["file_id"], _owner(request)))


async def file_content(request: web.Request) -> web.Response:
    data = request.app[FILES].content(request.match_info["file_id"], _owner(request))
    return web.Response(body=data, content_type="application/octet-stream")


async def delete_file(request: web.Request) -> web.Response:
    return web.json_response(request.app[FILES].delete(request.match_info["file_id"], _owner(request)))


async def create_batch(request: web.Request) -> web.Response:
    body = await read_json(request)
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    input_file_id, endpoint = body.get("input_file_id"), body.get("endpoint")
    window, metadata = body.get("completion_window", COMPLETION_WINDOW), body.get("metadata")
    if not isinstance(input_file_id, str):
        raise bad_request("'input_file_id' is required", "input_file_id")
    if endpoint not in ENDPOINTS:
        raise bad_request(f"'endpoint' must be one of {', '.join(ENDPOINTS)}", "endpoint")
    if window != COMPLETION_WINDOW:
        raise bad_request(f"'completion_window' must be {COMPLETION_WINDOW!r}", "completion_window")
    if metadata is not None and not (isinstance(metadata, dict) and len(metadata) <= 16 and all(
            isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512 for k, v in metadata.items())):
        raise bad_request("'metadata' must be at most 16 string keys (64 characters) to strings (512)", "metadata")
    files = request.app[FILES]
    owner = _owner(request)
    if files.get(input_file_id, owner)["purpose"] != "batch":
        raise bad_request(f"the file {input_file_id} is not a batch input (purpose 'batch')", "input_file_id")
    state = BatchState.create(files.root, input_file_id, endpoint, metadata, owner)
    request.app[RUNNER].poke()
    return web.json_response(state.view())


async def retrieve_batch(request: web.Request) -> web.Response:
    return web.json_response(BatchState.load(request.app[FILES].root, request.match_info["batch_id"],
                                             _owner(request)).view())


async def list_batches(request: web.Request) -> web.Response:
    owner = _owner(request)
    mine = [s.view() for s in BatchState.all(request.app[FILES].root) if s.owner == owner]
    return web.json_response(_page(mine, request))


async def cancel_batch(request: web.Request) -> web.Response:
    state = BatchState.load(request.app[FILES].root, request.match_info["batch_id"], _owner(request))
    if state.body["status"] not in ("validating", "in_progress", "finalizing", "cancelling"):
        raise APIError(409, f"Cannot cancel a batch with status '{state.body['status']}'.", "batch_id")
    state.request_cancel()
    return web.json_response(state.view())
