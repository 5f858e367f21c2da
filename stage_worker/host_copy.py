"""Several device tensors brought to the host in one copy: on a GPU each `.cpu()` / `.tolist()` / `.item()` is a
sync of its own, so a step that needs a few small tensors (token ids, flags, logprobs) would wait once per tensor,
or once per row. Their bytes are packed into one buffer on the device, copied once, and viewed back on the host,
bit for bit.
"""
from __future__ import annotations

import torch

_ALIGN = 8  # every part starts at a multiple of the widest element size, so each can be viewed as its dtype


def on_host(device: torch.device) -> bool:
    """Tensors on this device are the host's already: no copy to make, and packing them would only cost (on a CPU
    stage it made a sampler step up to a third slower at batch 1 and 8)."""
    return device.type == "cpu"


def to_host(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors (all on one device), on the CPU, in one device->host copy; same dtypes, shapes and bits."""
    if not tensors:
        return []
    if on_host(tensors[0].device):
        return list(tensors)
    parts, spans = [], []
    at = 0
    for t in tensors:
        raw = t.contiguous().reshape(-1).view(torch.uint8)
        pad = -raw.numel() % _ALIGN
        parts.append(torch.nn.functional.pad(raw, (0, pad)) if pad else raw)
        spans.append((at, raw.numel()))
        at += raw.numel() + pad
    host = torch.cat(parts).cpu()
    return [host[start:start + n].view(t.dtype).reshape(t.shape) for t, (start, n) in zip(tensors, spans)]
