"""Disaggregated prefill's read tickets: the KV a prefill replica holds for a request is handed out (ReadKV) only
to a reader that presents the ticket for those very blocks, which the prefill replica's scheduler writes into the
request's kv_transfer (the router gives it to the decode replica it picks, whose stages present it). A ticket is
an HMAC of the epoch and block ids under a key the scheduler makes when it starts and gives its stages when they
join (JoinPipeline): no other service of the mesh, internal token or not, can read a request's KV it was not
given, and a decode replica added later needs no configuration to be given one."""
from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Sequence

KEY_BYTES = 32


def new_key() -> bytes:
    return os.urandom(KEY_BYTES)


def ticket(key: bytes, epoch: int, block_ids: Sequence[int]) -> bytes:
    """The ticket for reading these blocks of this epoch."""
    message = f"{epoch}:{','.join(map(str, block_ids))}".encode()
    return hmac.new(key, message, hashlib.sha256).digest()


def valid(key: bytes, given: bytes, epoch: int, block_ids: Sequence[int]) -> bool:
    """Whether `given` is the ticket for these blocks (never with no key: a stage that joined no epoch)."""
    return bool(key) and hmac.compare_digest(given, ticket(key, epoch, block_ids))
