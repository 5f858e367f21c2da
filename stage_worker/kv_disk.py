"""The disk tier of a stage's KV (docs/kv-tiers.md): one file per block and TP rank, under a directory named by
a digest of everything that makes KV bytes valid (the model's weights, dtype, block size, heads, layers, TP size,
quantization), so that a changed model or layout never reads a foreign block.

DIR/<namespace>/namespace.json says in words what the digest covers; DIR/<namespace>/rank<t>/<hash>.kv are the
blocks. A file is a header (magic, format version, the length of a JSON description: namespace, block hash, TP
rank, tensor layout, payload length and its CRC-32) and the payload. Files are written by a background thread to a
temporary name and renamed (atomic); a read verifies everything, and a file that fails is a logged miss. Rank 0
holds an exclusive flock on DIR/<namespace>/.lock for its life: two stages never share one namespace directory.
"""
from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import os
import queue
import struct
import threading
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

from stagemesh.core.errors import StagemeshError

log = logging.getLogger("stagemesh.stage")

MAGIC, VERSION = b"SMKV", 1
HEADER = struct.Struct("<4sHI")  # magic, format version, length of the JSON description
MAX_DESCRIPTION = 1 << 16
SAMPLE_BYTES = 1 << 20  # of each weight file, at its start, middle and end
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth")
FULL_PAUSE_S = 30.0  # a full disk: no write for this long, then try again
WRITE_QUEUE_BYTES = 256 * 2**20
WARN_EVERY_S = 10.0


def model_fingerprint(model_dir: str | Path, gguf_file: str | Path | None = None) -> str:
    """A digest of the model's identity: config.json, the weight files' names and sizes, and BLAKE2b of a MiB at the
    start, middle and end of each (changed weights change it; a few MiB read per file)."""
    h = hashlib.blake2b(digest_size=16)
    root = Path(model_dir)
    config = root / "config.json"
    h.update(config.read_bytes() if config.is_file() else b"")
    files = sorted(p for p in root.iterdir() if p.suffix in WEIGHT_SUFFIXES and p.is_file())
    if gguf_file is not None:
        files.append(Path(gguf_file))
    for path in files:
        size = path.stat().st_size
        h.update(f"{path.name}\0{size}\0".encode())
        with open(path, "rb") as f:
            for offset in sorted({0, max(size // 2 - SAMPLE_BYTES // 2, 0), max(size - SAMPLE_BYTES, 0)}):
                f.seek(offset)
                h.update(f.read(SAMPLE_BYTES))
    return h.hexdigest()


def namespace_of(description: dict) -> str:
    return hashlib.blake2b(json.dumps(description, sort_keys=True).encode(), digest_size=16).hexdigest()


class RateLimitedLog:
    """A warning per reason at most every WARN_EVERY_S, saying how many were left out meanwhile."""

    def __init__(self) -> None:
        self._last: dict[str, float] = {}
        self._skipped: dict[str, int] = {}
        self._lock = threading.Lock()

    def warning(self, reason: str, message: str, *args) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self._last.get(reason, -WARN_EVERY_S) < WARN_EVERY_S:
                self._skipped[reason] = self._skipped.get(reason, 0) + 1
                return
            self._last[reason] = now
            skipped = self._skipped.pop(reason, 0)
        log.warning(message + (f" ({skipped} more like it not logged)" if skipped else ""), *args)


def check_writable(base: str | Path) -> None:
    """StagemeshError naming the path unless a file can be made in it (made if missing)."""
    path = Path(base)
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".probe-{os.getpid()}"
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as err:
        raise StagemeshError(f"--kv-offloading-disk-path {path}: not a writable directory "
                             f"({err.strerror or err}: {err.filename or path})") from None


class NamespaceDir:
    """Rank 0's hold on DIR/<namespace>: checked writable, locked for the stage's life, cleared of temporary files."""

    def __init__(self, base: str | Path, description: dict, tp_size: int, about: dict | None = None):
        """`about`: said in namespace.json too, not part of the digest (the model's path, which may move)."""
        self.base = Path(base)
        self.namespace = namespace_of(description)
        self.path = self.base / self.namespace
        check_writable(self.path)
        try:
            self._lock = open(self.path / ".lock", "a")
        except OSError as err:
            raise StagemeshError(f"--kv-offloading-disk-path {self.base}: not a writable directory "
                                 f"({err.strerror or err}: {err.filename or self.path})") from None
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self._lock.close()
            raise StagemeshError(f"--kv-offloading-disk-path: {self.path} is in use by another stage process (it "
                                 f"holds {self.path / '.lock'}); give each replica a directory of its own "
                                 "(`stagemesh serve` uses DIR/replica-<i>)") from None
        about = {"namespace": self.namespace, **description, **(about or {})}
        (self.path / "namespace.json").write_text(json.dumps(about, indent=2, sort_keys=True) + "\n")
        for t in range(tp_size):
            rank_dir = self.path / f"rank{t}"
            rank_dir.mkdir(exist_ok=True)
            for tmp in rank_dir.glob(".*.tmp*"):  # what a stage that died mid-write left
                tmp.unlink(missing_ok=True)

    def common_hashes(self, tp_size: int) -> list[int]:
        """Hashes every TP rank holds a file of, least recently written (rank 0's) first."""
        ranks = [_listing(self.path / f"rank{t}") for t in range(tp_size)]
        others = [set(h for h, _ in r) for r in ranks[1:]]
        return [h for h, _ in ranks[0] if all(h in o for o in others)]

    def close(self) -> None:
        self._lock.close()


def _listing(rank_dir: Path) -> list[tuple[int, float]]:
    out = []
    try:
        entries = list(os.scandir(rank_dir))
    except OSError:
        return []
    for entry in entries:
        name = entry.name
        if len(name) == 19 and name.endswith(".kv"):
            try:
                out.append((int(name[:16], 16), entry.stat().st_mtime))
            except (ValueError, OSError):
                continue
    out.sort(key=lambda x: x[1])
    return out


@dataclass
class DiskStats:
    written: int = 0
    dropped: int = 0  # the write queue was full, or the disk
    read_hits: int = 0
    read_misses: int = 0
    full_pauses: int = 0
    errors: int = 0


@dataclass
class _Queue:
    items: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    pending: dict[int, memoryview] = field(default_factory=dict)  # written soon: a read finds them here
    bytes: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


class DiskTier:
    """One TP rank's files in DIR/<namespace>/rank<t>. `layout`: (dtype name, shape) of each tensor of a block, in
    the payload's order."""

    def __init__(self, path: str | Path, namespace: str, tp_rank: int, layout: list[tuple[str, tuple[int, ...]]],
                 max_queue_bytes: int = WRITE_QUEUE_BYTES, full_pause_s: float = FULL_PAUSE_S):
        self.dir = Path(path) / f"rank{tp_rank}"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.namespace, self.tp_rank = namespace, tp_rank
        self.layout = [[dtype, list(shape)] for dtype, shape in layout]
        self.payload_bytes = sum(nbytes(dtype, shape) for dtype, shape in layout)
        self.max_queue_bytes, self.full_pause_s = max_queue_bytes, full_pause_s
        self.stats = DiskStats()
        self.warn = RateLimitedLog()
        self._paused_until = 0.0
        self._full_warned = False
        self._q = _Queue()
        self._idle = threading.Event()
        self._idle.set()
        self._thread = threading.Thread(target=self._write_loop, name=f"kv-disk-writer-{tp_rank}", daemon=True)
        self._thread.start()

    def file_of(self, block_hash: int) -> Path:
        return self.dir / f"{block_hash:016x}.kv"

    def _description(self, block_hash: int) -> dict:
        return {"namespace": self.namespace, "hash": block_hash, "tp_rank": self.tp_rank, "layout": self.layout,
                "payload_bytes": self.payload_bytes}

    # -- writes (the writer thread) ------------------------------------------------------
    def write(self, block_hash: int, payload: memoryview) -> bool:
        """Queue the block's payload for writing; False (counted, logged) when the queue is full or the disk was."""
        if len(payload) != self.payload_bytes:
            raise ValueError(f"a payload of {len(payload)} bytes for blocks of {self.payload_bytes}")
        q = self._q
        with q.lock:
            if q.bytes + len(payload) > self.max_queue_bytes or time.monotonic() < self._paused_until:
                self.stats.dropped += 1
                full = q.bytes + len(payload) > self.max_queue_bytes
            else:
                q.bytes += len(payload)
                q.pending[block_hash] = payload
                self._idle.clear()
                q.items.put(("write", block_hash, payload))
                return True
        if full:
            self.warn.warning("queue", "KV disk tier: the write queue holds %d bytes: a block write was dropped",
                              self.max_queue_bytes)
        return False

    def delete(self, hashes: list[int]) -> None:
        """Remove the blocks' files (after the writes queued before)."""
        if hashes:
            self._idle.clear()
            self._q.items.put(("delete", 0, list(hashes)))

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every queued write and delete is done (tests, shutdown)."""
        return self._idle.wait(timeout)

    def close(self) -> None:
        self._q.items.put(None)

    def _write_loop(self) -> None:
        q = self._q
        while True:
            item = q.items.get()
            if item is None:
                return
            kind, block_hash, data = item
            try:
                if kind == "delete":
                    for h in data:
                        self.file_of(h).unlink(missing_ok=True)
                        q.pending.pop(h, None)
                else:
                    self._write_file(block_hash, data)
            except Exception as err:  # noqa: BLE001 - a write is only an optimisation; the writer goes on
                self.stats.errors += 1
                self.warn.warning("error", "KV disk tier: %s", err)
            finally:
                if kind == "write":
                    with q.lock:
                        q.bytes -= len(data)
                        if q.pending.get(block_hash) is data:
                            del q.pending[block_hash]
                if q.items.empty():
                    self._idle.set()

    def _write_file(self, block_hash: int, payload: memoryview) -> None:
        if time.monotonic() < self._paused_until:
            self.stats.dropped += 1
            return
        description = dict(self._description(block_hash), crc32=zlib.crc32(payload))
        text = json.dumps(description, sort_keys=True).encode()
        final = self.file_of(block_hash)
        tmp = self.dir / f".{final.name}.tmp{os.getpid()}"
        try:
            with open(tmp, "wb") as f:
                f.write(HEADER.pack(MAGIC, VERSION, len(text)) + text)
                f.write(payload)
            os.replace(tmp, final)
        except OSError as err:
            tmp.unlink(missing_ok=True)
            if err.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            self.stats.dropped += 1
            self._paused_until = time.monotonic() + self.full_pause_s
            self.stats.full_pauses += 1
            if not self._full_warned:
                self._full_warned = True
                log.warning("KV disk tier: %s is full (%s): no block is written for %.0f s at a time while it "
                            "stays full; reads go on", self.dir, err.strerror, self.full_pause_s)
            return
        self.stats.written += 1

    # -- reads (any thread) --------------------------------------------------------------
    def read(self, block_hash: int) -> bytearray | memoryview | None:
        """The block's verified payload, or None: a miss (missing, truncated, corrupt or foreign file), logged."""
        pending = self._q.pending.get(block_hash)
        if pending is not None:
            self.stats.read_hits += 1
            return pending
        path = self.file_of(block_hash)
        try:
            payload, reason = self._read_file(path, block_hash)
        except OSError as err:
            payload, reason = None, err.strerror or str(err)
        if payload is None:
            self.stats.read_misses += 1
            self.warn.warning(f"miss:{reason}", "KV disk tier: %s is not loaded: %s", path, reason)
        else:
            self.stats.read_hits += 1
        return payload

    def _read_file(self, path: Path, block_hash: int) -> tuple[bytearray | None, str]:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(HEADER.size)
            if len(head) < HEADER.size:
                return None, "truncated header"
            magic, version, length = HEADER.unpack(head)
            if magic != MAGIC or version != VERSION:
                return None, f"not a KV block file of format {VERSION}"
            if length > MAX_DESCRIPTION or HEADER.size + length > size:
                return None, "truncated or corrupt header"
            try:
                description = json.loads(f.read(length))
                crc = description.pop("crc32")
            except (ValueError, KeyError, AttributeError, TypeError):
                return None, "corrupt header"
            if description != self._description(block_hash):
                ns = description.get("namespace") if isinstance(description, dict) else None
                return None, ("written for another model or layout" if ns != self.namespace
                              else "its header does not describe this block")
            if size - HEADER.size - length != self.payload_bytes:
                return None, f"{size - HEADER.size - length} payload bytes, {self.payload_bytes} expected (truncated)"
            payload = bytearray(self.payload_bytes)
            if f.readinto(payload) != self.payload_bytes:
                return None, "truncated payload"
        if zlib.crc32(payload) != crc:
            return None, "payload checksum mismatch (corrupt)"
        return payload, ""

    def hashes(self) -> list[int]:
        """The blocks this rank has files of, least recently written first."""
        return [h for h, _ in _listing(self.dir)]


def nbytes(dtype: str, shape) -> int:
    import torch

    n = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    for d in shape:
        n *= d
    return n
