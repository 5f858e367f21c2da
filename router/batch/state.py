"""A batch as it is kept under --batch-dir/batches: its OpenAI Batch object (<id>.json, written whole each time),
its results so far (<id>.progress.jsonl, one line per input line done, appended as each is done), a cancel flag
(<id>.cancel) and the lock of the router running it (<id>.lock). What the input lines are, and their records in
the output and error files, in OpenAI's shapes."""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from router.batch.files import FileStore, _valid_id, write_atomically
from router.errors import APIError

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")
BATCH_PRIORITY = 10  # a batch line's priority under --scheduling-policy priority (interactive requests: 0)
COMPLETION_WINDOW = "24h"  # the only one OpenAI takes
TENANT_FIELD = "stagemesh_tenant"  # (in the batch's file, not in the Batch object: BatchState.view)


@dataclass
class BatchState:
    root: Path
    body: dict  # the Batch object

    @property
    def id(self) -> str:
        return self.body["id"]

    @property
    def owner(self) -> str | None:
        """The tenant whose batch it is (None: no tenants); its output files are that tenant's too."""
        return self.body.get(TENANT_FIELD)

    @staticmethod
    def _dir(root: Path) -> Path:
        path = root / "batches"
        path.mkdir(parents=True, exist_ok=True)
        return path

    @property
    def lock_path(self) -> Path:
        return self._dir(self.root) / f"{self.id}.lock"

    @property
    def _progress(self) -> Path:
        return self._dir(self.root) / f"{self.id}.progress.jsonl"

    @property
    def _cancel(self) -> Path:
        return self._dir(self.root) / f"{self.id}.cancel"

    @classmethod
    def create(cls, root: Path, input_file_id: str, endpoint: str, metadata: dict | None,
               tenant: str | None = None) -> BatchState:
        now = int(time.time())
        body = {"id": f"batch_{uuid.uuid4().hex}", "object": "batch", "endpoint": endpoint, "errors": None,
                "input_file_id": input_file_id, "completion_window": COMPLETION_WINDOW, "status": "validating",
                "output_file_id": None, "error_file_id": None, "created_at": now, "in_progress_at": None,
                "expires_at": now + 24 * 3600, "finalizing_at": None, "completed_at": None, "failed_at": None,
                "expired_at": None, "cancelling_at": None, "cancelled_at": None,
                "request_counts": {"total": 0, "completed": 0, "failed": 0}, "metadata": metadata}
        if tenant is not None:  # (its lines run as that tenant's requests: router.batch.runner)
            body[TENANT_FIELD] = tenant
        state = cls(root, body)
        state.save()
        return state

    @classmethod
    def read(cls, root: Path, batch_id: str) -> BatchState:
        """The batch, whoever owns it (the runner's read; a client's is load)."""
        path = cls._dir(root) / f"{batch_id}.json"
        if not _valid_id(batch_id, "batch_") or not path.is_file():
            raise APIError(404, f"No such Batch object: {batch_id[:80]}", "batch_id")
        return cls(root, json.loads(path.read_text()))

    @classmethod
    def load(cls, root: Path, batch_id: str, owner: str | None) -> BatchState:
        """The batch, if `owner` owns it (404 otherwise, as for an id that never was: another tenant's batches
        are not there for it)."""
        state = cls.read(root, batch_id)
        if state.owner != owner:
            raise APIError(404, f"No such Batch object: {batch_id[:80]}", "batch_id")
        return state

    @classmethod
    def all(cls, root: Path) -> list[BatchState]:
        out = []
        for path in cls._dir(root).glob("batch_*.json"):
            try:
                out.append(cls(root, json.loads(path.read_text())))
            except (OSError, ValueError):  # (being replaced: seen at the next scan)
                continue
        return sorted(out, key=lambda s: (s.body["created_at"], s.id), reverse=True)

    def save(self) -> None:
        write_atomically(self._dir(self.root) / f"{self.id}.json", json.dumps(self.body).encode())

    def view(self) -> dict:
        """The Batch object as a client sees it: cancelling once a cancel is asked, until the runner ends it."""
        if self.body["status"] in ACTIVE and self.cancel_requested() and self.body["status"] != "cancelling":
            return {**self._public, "status": "cancelling", "cancelling_at": int(self._cancel.stat().st_mtime)}
        return self._public

    @property
    def _public(self) -> dict:
        return {k: v for k, v in self.body.items() if k != TENANT_FIELD}

    # -- cancelling ---------------------------------------------------------------------------------
    def request_cancel(self) -> None:
        self._cancel.touch()

    def cancel_requested(self) -> bool:
        return self._cancel.exists()

    # -- running (router.batch.runner, under the batch's lock) ----------------------------------------
    def start(self, total: int) -> None:
        b = self.body
        if b["status"] == "validating":
            b["status"], b["in_progress_at"] = "in_progress", int(time.time())
        b["request_counts"]["total"] = total
        self._count()

    def done_indices(self) -> set[int]:
        return {r["index"] for r in self._records()}

    def _records(self) -> list[dict]:
        if not self._progress.is_file():
            return []
        out = []
        for line in self._progress.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:  # a line cut by a kill as it was written: that input line runs again
                continue
        return out

    def record(self, index: int, ok: bool, record: dict) -> None:
        with open(self._progress, "a") as f:
            f.write(json.dumps({"index": index, "ok": ok, "record": record}) + "\n")
        counts = self.body["request_counts"]
        counts["completed" if ok else "failed"] += 1
        self.save()

    def _count(self) -> None:
        records = {r["index"]: r for r in self._records()}  # (the last of a line run twice)
        self.body["request_counts"].update(completed=sum(r["ok"] for r in records.values()),
                                           failed=sum(not r["ok"] for r in records.values()))
        self.save()

    def finish(self, files: FileStore, total: int) -> None:
        """The output and error files, in input order; completed, or cancelled when a cancel stopped it."""
        b = self.body
        cancelled = self.cancel_requested()
        b["status"], b["finalizing_at"] = "finalizing", int(time.time())
        self.save()
        records = {r["index"]: r for r in self._records()}
        ordered = [records[i] for i in sorted(records)]
        ok = [json.dumps(r["record"]) for r in ordered if r["ok"]]
        bad = [json.dumps(r["record"]) for r in ordered if not r["ok"]]
        if ok:
            b["output_file_id"] = files.write(("\n".join(ok) + "\n").encode(), f"{self.id}_output.jsonl",
                                              "batch_output", self.owner)["id"]
        if bad:
            b["error_file_id"] = files.write(("\n".join(bad) + "\n").encode(), f"{self.id}_error.jsonl",
                                             "batch_output", self.owner)["id"]
        b["request_counts"].update(total=total, completed=len(ok), failed=len(bad))
        now = int(time.time())
        if cancelled:
            b["status"], b["cancelling_at"], b["cancelled_at"] = "cancelled", b["cancelling_at"] or now, now
        else:
            b["status"], b["completed_at"] = "completed", now
        self.save()

    def fail(self, message: str) -> None:
        self.body.update(status="failed", failed_at=int(time.time()),
                         errors={"object": "list", "data": [{"code": "batch_failed", "message": message,
                                                             "param": None, "line": None}]})
        self.save()


def load_lines(path: Path) -> list[str]:
    """The input file's requests: its non-empty lines, in order."""
    return [line for line in path.read_text(encoding="utf-8", errors="replace").splitlines() if line.strip()]


def parse_line(line: str, endpoint: str, seen: set[str]) -> tuple[dict | None, dict | None]:
    """(the request, None), or (None, the error) for a line that is not one: not JSON, no custom_id (or one seen
    before), another method or endpoint than the batch's, no body object, a stream."""
    try:
        request = json.loads(line)
    except ValueError as err:
        return None, {"code": "invalid_json", "message": f"the line is not JSON: {err}", "custom_id": None}
    if not isinstance(request, dict):
        return None, {"code": "invalid_request", "message": "the line must be a JSON object", "custom_id": None}
    custom_id = request.get("custom_id")

    def fail(code: str, message: str) -> tuple[None, dict]:
        return None, {"code": code, "message": message, "custom_id": custom_id}
    if not isinstance(custom_id, str) or not custom_id:
        return fail("missing_required_parameter", "the line has no 'custom_id' (a string)")
    if custom_id in seen:
        return fail("duplicate_custom_id", f"the custom_id {custom_id!r} is not unique in the file")
    seen.add(custom_id)
    if request.get("method") != "POST":
        return fail("invalid_method", "the line's 'method' must be POST")
    if request.get("url") != endpoint:
        return fail("invalid_url", f"the line's 'url' {str(request.get('url'))[:100]!r} is not the batch's "
                                   f"endpoint {endpoint}")
    if not isinstance(request.get("body"), dict):
        return fail("invalid_request", "the line's 'body' must be a JSON object")
    if request["body"].get("stream"):
        return fail("invalid_request", "'stream' is not available in a batch")
    return request, None


def error_record(batch_id: str, index: int, error: dict) -> dict:
    return {"id": _record_id(batch_id, index), "custom_id": error.pop("custom_id"), "response": None, "error": error}


def result_record(batch_id: str, index: int, custom_id: str, status: int, request_id: str, body) -> dict:
    return {"id": _record_id(batch_id, index), "custom_id": custom_id,
            "response": {"status_code": status, "request_id": request_id, "body": body}, "error": None}


def _record_id(batch_id: str, index: int) -> str:
    return f"batch_req_{batch_id.removeprefix('batch_')}_{index}"
