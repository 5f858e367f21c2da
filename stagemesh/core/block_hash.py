"""The hash of a full KV block: its tokens chained to the hash of the block before it.

The scheduler's prefix cache keys its blocks with it, and a router computes the same hashes from a
prompt to ask which replica holds that prefix (its KV events name blocks by these hashes), so it must
be the same in every process: Python's hash() is not (hash(None) follows the address of None).
"""
from __future__ import annotations

import hashlib
import struct


def chain_hash(parent: int | None, token_ids: tuple[int, ...] | list[int]) -> int:
    """A 64-bit hash of the block's token ids and its parent block's hash (None for a prompt's first block)."""
    packed = struct.pack(f"<Q{len(token_ids)}i", 0 if parent is None else parent, *token_ids)
    return int.from_bytes(hashlib.blake2b(packed, digest_size=8).digest(), "little")


def prefix_hashes(token_ids: list[int], block_size: int) -> list[int]:
    """The chained hashes of every full block of token_ids, in order."""
    hashes, parent = [], None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = chain_hash(parent, token_ids[start:start + block_size])
        hashes.append(parent)
    return hashes
