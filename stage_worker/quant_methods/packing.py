"""Integers packed into int32 words, as the quantizers pack them: `bits`-wide fields from the low bits up,
along one dimension of the tensor; `order` (AWQ's interleaving) says which element each field holds."""
from __future__ import annotations

import torch


def unpack_int32(packed: torch.Tensor, bits: int, dim: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """int32 [..] -> uint8 codes with `dim` 32 / bits times longer. Field i of a word holds element
    order[i] of its run (None: element i)."""
    per = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    words = packed.to(torch.int32).movedim(dim, -1)
    fields = (words.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [..., words, per]: field i at i
    if order is not None:
        fields = fields[..., list(inverse(order))]
    out = fields.reshape(*words.shape[:-1], words.shape[-1] * per).to(torch.uint8)
    return out.movedim(-1, dim)


def pack_int32(codes: torch.Tensor, bits: int, dim: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """The inverse of unpack_int32 (tests write checkpoints with it as the quantizers do)."""
    per = 32 // bits
    values = codes.to(torch.int64).movedim(dim, -1)
    runs = values.reshape(*values.shape[:-1], values.shape[-1] // per, per)
    if order is not None:
        runs = runs[..., list(order)]
    shifts = torch.arange(0, 32, bits, dtype=torch.int64)
    words = (runs << shifts).sum(-1)
    words = torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)
    return words.movedim(-1, dim)


def inverse(order: tuple[int, ...]) -> tuple[int, ...]:
    """The field of each element: inverse(order)[element] = field."""
    out = [0] * len(order)
    for i, e in enumerate(order):
        out[e] = i
    return tuple(out)
