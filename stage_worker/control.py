"""The one control channel from a stage's TP rank 0 to its followers: a pipe into each follower's stdin, as
long-lived as the follower, carrying every instruction in order: join an epoch, run a step, read or write KV
blocks, store and load KV tiers, move experts, leave. Tensors (hidden states, all-reduces, gathered KV) go over
the epoch's TP group; instructions never do, so a follower needs no epoch to be told what to do, and rank 0 never
waits on a follower to hand it one (a pipe write returns once the bytes are in the pipe).

A message is its kind (u8), the epoch it belongs to (u32), its payload's length (u32) and the payload. A
follower acts on an epoch's messages only while it is in that epoch: after its epoch broke under it (a peer
died) it skips what rank 0 sent for that epoch until the next JOIN. Followers are rank 0's children on its
host (stage_worker.worker), so the pipe is the channel on every device; nothing in it is unpickled.
"""
from __future__ import annotations

import fcntl
import os
import select
import struct
import threading
import time
from collections.abc import Sequence
from typing import IO, Protocol

from stagemesh.core.errors import StagemeshError

# KV_TIER_*: the host and disk KV tiers (stage_worker.kv_tier_ranks); LORA_*: an adapter loaded or unloaded at
# run time (JSON {"name", "path"}), which belongs to no epoch: a follower acts on it whatever epoch it is in
# START: the follower's first message, what it is to run (JSON: stage_worker.follower.start_message)
JOIN, FORWARD, LEAVE, KV_EXPORT, KV_IMPORT, EPLB_REBALANCE, KV_TIER_STORE, KV_TIER_READ, KV_TIER_FILL, \
    LORA_LOAD, LORA_UNLOAD, START = range(12)
HEADER = struct.Struct("<BII")
PIPE_BYTES = 2**20  # a long prefill's step fits the pipe: rank 0 writes it without waiting for the reader
_F_SETPIPE_SZ = 1031  # Linux's fcntl


def frame(kind: int, epoch: int, payload: bytes = b"") -> bytes:
    """One message as it crosses the pipe."""
    return HEADER.pack(kind, epoch, len(payload)) + payload


class FollowerProcess(Protocol):
    """What rank 0 holds a follower by: a subprocess.Popen, or a forked one (stage_worker.follower_start)."""
    @property
    def stdin(self) -> IO[bytes] | None: ...

    def poll(self) -> int | None: ...


class FollowerChannel:
    """Rank 0's end: the followers' stdin pipes, written by whichever thread has a message (one at a time)."""

    def __init__(self, followers: Sequence[FollowerProcess]):
        self.followers = followers
        self._lock = threading.Lock()
        for proc in followers:
            assert proc.stdin is not None  # (started with stdin=PIPE: stage_worker.worker)
            try:
                fcntl.fcntl(proc.stdin.fileno(), _F_SETPIPE_SZ, PIPE_BYTES)
            except OSError:  # not Linux, or above the system's pipe-max-size: the default size works, slower
                pass

    def send(self, kind: int, epoch: int, payload: bytes = b"") -> None:
        message = frame(kind, epoch, payload)
        with self._lock:
            for t, proc in enumerate(self.followers, start=1):
                assert proc.stdin is not None
                try:
                    proc.stdin.write(message)
                    proc.stdin.flush()
                except OSError:
                    raise StagemeshError(f"TP follower {t} is gone (exit code {proc.poll()})") from None


class Reader:
    """A follower's end. While steps come it polls the pipe (yielding the core between polls) so that a step
    starts as soon as rank 0 sent it, not a scheduler wake-up later (rank 0 would wait for it in the first
    all-reduce); after SPIN_S with nothing it blocks in select, so an idle follower takes no CPU."""

    SPIN_S = 0.005

    def __init__(self, fd: int):
        self.fd = fd
        os.set_blocking(fd, False)
        self.buf = bytearray()

    def read(self) -> tuple[int, int, bytes] | None:
        """The next (kind, epoch, payload) from rank 0; None once its end of the pipe is closed."""
        if not self._fill(HEADER.size):
            return None
        kind, epoch, size = HEADER.unpack_from(self.buf)
        if not self._fill(HEADER.size + size):
            return None
        payload = bytes(self.buf[HEADER.size:HEADER.size + size])
        del self.buf[:HEADER.size + size]
        return kind, epoch, payload

    def peek(self) -> int | None:
        """The next message's kind without taking it; None once rank 0's end of the pipe is closed."""
        return self.buf[0] if self._fill(HEADER.size) else None

    def _fill(self, n: int) -> bool:
        spin_until = time.monotonic() + self.SPIN_S
        while len(self.buf) < n:
            try:
                chunk = os.read(self.fd, max(n - len(self.buf), 2**16))
            except BlockingIOError:
                if time.monotonic() < spin_until:
                    os.sched_yield()
                else:
                    select.select([self.fd], [], [])
                continue
            if not chunk:
                return False
            self.buf += chunk
        return True


def step_message(step_bytes: bytes, filled: list[int]) -> bytes:
    """A FORWARD payload: the count and int32 values of the tokens a step run ahead was filled with (none
    otherwise), then the step's StepBatch bytes as the scheduler sent them (no rank encodes a step again)."""
    return struct.pack(f"<I{len(filled)}i", len(filled), *filled) + step_bytes


def read_step_message(payload: bytes) -> tuple[list[int], bytes]:
    """(filled tokens, StepBatch bytes) of a FORWARD payload."""
    (count,) = struct.unpack_from("<I", payload)
    return list(struct.unpack_from(f"<{count}i", payload, 4)), payload[4 + 4 * count:]
