"""A read Part (stage_worker.quant_methods.method) in the kernels' layout (kernels/quant_reference.py): groups
of a multiple of 32 contiguous columns, a scale (and, 4-bit, a min) per row and group.

Groups that already are that (the usual case) are kept as they are. Otherwise (GPTQ's desc_act, whose g_idx
scatters a group's columns over the row; a TP shard that cuts groups; groups narrower than 32) the columns
are sorted by group and each group's run padded to a multiple of 32: the product then gathers x's columns
in that order (QuantizedWeight.columns; a padding column reads a zero), so every number stays the checkpoint's.
"""
from __future__ import annotations

import torch

from kernels.quant_reference import CHUNK, pack_4bit
from stage_worker.quant_methods.method import Part


class Layout:
    """qs, scales, mins as QuantizedWeight takes them, and the column order of x (None: as it is)."""

    def __init__(self, qs: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
                 columns: torch.Tensor | None):
        self.qs, self.scales, self.mins, self.columns = qs, scales, mins, columns


def _contiguous_groups(gid: torch.Tensor) -> int | None:
    """The group width if gid is runs of equal width (a multiple of 32) in order 0, 1, 2, ...; else None."""
    cols = gid.numel()
    _, counts = torch.unique_consecutive(gid, return_counts=True)
    width = int(counts[0])
    if width % CHUNK or cols % width or not torch.equal(gid, torch.arange(cols) // width + int(gid[0])):
        return None
    return width


def _padded_order(gid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(columns, group of each chunk of 32): the columns sorted by group (stable), each group's run padded
    with the index `cols` (a zero column of x) to a multiple of 32."""
    cols = gid.numel()
    order = torch.argsort(gid, stable=True)
    groups, counts = torch.unique_consecutive(gid[order], return_counts=True)
    pieces, chunk_groups, at = [], [], 0
    for g, n in zip(groups.tolist(), counts.tolist()):
        padded = -(-n // CHUNK) * CHUNK
        pieces += [order[at:at + n], torch.full((padded - n,), cols, dtype=torch.int64)]
        chunk_groups += [g] * (padded // CHUNK)
        at += n
    return torch.cat(pieces), torch.tensor(chunk_groups, dtype=torch.int64)


def layout(part: Part) -> Layout:
    q, scales, zeros = part.q, part.scales, part.zeros
    width = _contiguous_groups(part.gid)
    columns = None
    if width is not None:
        picked = part.gid[::width]
    else:
        columns, picked = _padded_order(part.gid)
        raw = q.view(torch.uint8) if q.dtype == torch.float8_e4m3fn else q  # (fp8 has no indexing of its own)
        q = torch.cat([raw, raw.new_zeros(raw.shape[0], 1)], 1)[:, columns].view(q.dtype)
    s = scales[:, picked].float().contiguous()
    if part.bits == 4:
        assert zeros is not None, "4-bit parts carry their zero points (8 where symmetric)"
        return Layout(pack_4bit(q), s, (-s * zeros[:, picked].float()).contiguous(), columns)
    assert zeros is None, "8-bit parts are symmetric (the kernels take no mins for them)"
    return Layout(q.contiguous(), s, None, columns)
