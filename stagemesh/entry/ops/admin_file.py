"""Where a running serve's admin API is, for the commands on the same host: a file per serve under the stagemesh
cache (admin/serve-<pid>.json, mode 0600 in a 0700 folder) with its URL and, when serve generated its admin key,
the key. serve removes it when it exits; a file whose serve is gone is ignored."""
from __future__ import annotations

import json
import os
from pathlib import Path

from stagemesh.core.default_model import cache_root
from stagemesh.core.errors import StagemeshError

ENV_KEY = "STAGEMESH_ADMIN_API_KEY"
ENV_URL = "STAGEMESH_ADMIN_URL"


def admin_dir() -> Path:
    return cache_root() / "admin"


def write(url: str, key: str | None) -> Path:
    """This serve's file (readable by its user alone); `key` only when serve generated it."""
    folder = admin_dir()
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(folder, 0o700)
    path = folder / f"serve-{os.getpid()}.json"
    tmp = path.with_suffix(".tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"url": url, "pid": os.getpid(), **({"key": key} if key else {})}, f)
    os.replace(tmp, path)
    return path


def running() -> list[dict]:
    """The admin files of the serves that still run here."""
    found = []
    for path in sorted(admin_dir().glob("serve-*.json")):
        try:
            entry = json.loads(path.read_text())
            os.kill(int(entry["pid"]), 0)
        except (OSError, ValueError, KeyError, TypeError):
            continue  # gone (or not ours to read)
        found.append(entry)
    return found


def discover(url: str | None, key: str | None) -> tuple[str, str]:
    """(the admin URL, the key) from the flags, else the environment, else this host's one running serve."""
    url = url or os.environ.get(ENV_URL) or None
    key = key or os.environ.get(ENV_KEY) or None
    entries = running()
    if url is None:
        if not entries:
            raise StagemeshError(f"no running `stagemesh serve` with an admin API found on this host (under "
                                 f"{admin_dir()}): give --admin-url (or ${ENV_URL})")
        if len(entries) > 1:
            raise StagemeshError("several `stagemesh serve` run on this host: give --admin-url, one of "
                                 + ", ".join(e["url"] for e in entries))
        url = entries[0]["url"]
    url = url.rstrip("/")
    if key is None:
        key = next((e.get("key") for e in entries if e["url"] == url and e.get("key")), None)
    if key is None:
        raise StagemeshError(f"no admin key for {url}: give --admin-api-key (or ${ENV_KEY}), the key that serve "
                             "was started with")
    return url, key
