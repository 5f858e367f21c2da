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


def adapter_root(lora_name: str) -> int | None:
    """The parent of a prompt's first block under a LoRA adapter (None: the base model's). KV computed under
    one adapter is another adapter's, or the base model's, under no hash."""
    if not lora_name:
        return None
    return int.from_bytes(hashlib.blake2b(b"lora\0" + lora_name.encode(), digest_size=8).digest(), "little")


def prefix_hashes(token_ids: list[int], block_size: int, root: int | None = None) -> list[int]:
    """The chained hashes of every full block of token_ids, in order; `root`: the first block's parent
    (adapter_root)."""
    hashes, parent = [], root
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = chain_hash(parent, token_ids[start:start + block_size])
        hashes.append(parent)
    return hashes
