"""The Files API's store (purpose "batch"): each file's bytes and its OpenAI File object under --batch-dir/files,
written whole before they are seen (a temporary name, then a rename), so that a file survives a restart and a
router killed while one uploads leaves none half-written. Several routers on one host share the directory.

With tenants (--api-keys-file), a file belongs to the tenant that uploaded it (or whose batch wrote it): another
tenant's id is a 404 to every call, and lists hold the caller's own files only, as OpenAI's organisations keep
theirs apart. The owner is kept in the file's object on disk, never shown."""
from __future__ import annotations

import json
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator

from router.errors import APIError

PURPOSES = ("batch", "batch_output")  # what a client uploads, what a batch writes
OWNER_FIELD = "stagemesh_owner"  # the tenant a file belongs to (None: no tenants)


def write_atomically(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


@dataclass
class FileStore:
    root: Path
    max_bytes: int  # --batch-max-file-bytes: an upload past it is a 413 that says so

    def __post_init__(self) -> None:
        (self.root / "files").mkdir(parents=True, exist_ok=True)

    def _meta(self, file_id: str) -> Path:
        return self.root / "files" / f"{file_id}.json"

    def path(self, file_id: str) -> Path:
        return self.root / "files" / f"{file_id}.jsonl"

    async def upload(self, chunks: AsyncIterator[bytes], filename: str, purpose: str,
                     owner: str | None = None) -> dict:
        """Keep an uploaded file, read chunk by chunk and refused (413) once past max_bytes."""
        file_id = f"file-{uuid.uuid4().hex}"
        tmp = self.root / "files" / f".{file_id}.upload"
        size = 0
        try:
            with open(tmp, "wb") as out:
                async for chunk in chunks:
                    size += len(chunk)
                    if size > self.max_bytes:
                        raise APIError(413, f"the file is larger than this server's limit of {self.max_bytes:,} "
                                            "bytes (--batch-max-file-bytes)", "file")
                    out.write(chunk)
            os.replace(tmp, self.path(file_id))
        finally:
            tmp.unlink(missing_ok=True)
        return self.add_meta(file_id, filename, purpose, size, owner)

    def add_meta(self, file_id: str, filename: str, purpose: str, size: int, owner: str | None = None) -> dict:
        meta = {"id": file_id, "object": "file", "bytes": size, "created_at": int(time.time()), "filename": filename,
                "purpose": purpose, "status": "processed", "expires_at": None, "status_details": None}
        write_atomically(self._meta(file_id), json.dumps({**meta, OWNER_FIELD: owner}).encode())
        return meta

    def write(self, data: bytes, filename: str, purpose: str, owner: str | None = None) -> dict:
        """A file the server makes (a batch's output or errors), the batch's tenant's."""
        file_id = f"file-{uuid.uuid4().hex}"
        write_atomically(self.path(file_id), data)
        return self.add_meta(file_id, filename, purpose, len(data), owner)

    def get(self, file_id: str, owner: str | None = None) -> dict:
        """The File object, if `owner` owns it (404 otherwise, as for an id that never was)."""
        meta = self._meta(file_id) if _valid_id(file_id, "file-") else None
        value = json.loads(meta.read_text()) if meta is not None and meta.is_file() else None
        if value is None or value.get(OWNER_FIELD) != owner:
            raise APIError(404, f"No such File object: {file_id[:80]}", "file_id")
        return _public(value)

    def content(self, file_id: str, owner: str | None = None) -> bytes:
        self.get(file_id, owner)
        return self.path(file_id).read_bytes()

    def delete(self, file_id: str, owner: str | None = None) -> dict:
        self.get(file_id, owner)
        self._meta(file_id).unlink(missing_ok=True)
        self.path(file_id).unlink(missing_ok=True)
        return {"id": file_id, "object": "file", "deleted": True}

    def list(self, purpose: str | None = None, owner: str | None = None) -> list[dict]:
        """`owner`'s files' objects, the newest first."""
        out = []
        for meta in (self.root / "files").glob("file-*.json"):
            try:
                value = json.loads(meta.read_text())
            except (OSError, ValueError):  # (deleted meanwhile)
                continue
            if value.get(OWNER_FIELD) == owner and (purpose is None or value.get("purpose") == purpose):
                out.append(_public(value))
        return sorted(out, key=lambda f: (f["created_at"], f["id"]), reverse=True)


def _public(meta: dict) -> dict:
    return {k: v for k, v in meta.items() if k != OWNER_FIELD}


def _valid_id(value: str, prefix: str) -> bool:
    """An id this server made: its prefix and hex digits, never a path."""
    rest = value[len(prefix):]
    return value.startswith(prefix) and 0 < len(rest) <= 64 and all(c in "0123456789abcdef" for c in rest)
