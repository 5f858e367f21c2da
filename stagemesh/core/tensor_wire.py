"""Tensors across processes: raw bytes with dtype and shape, never pickled (apart from stagemesh.core.wire,
so that what does not move tensors, the router and the client, never loads torch)."""
from __future__ import annotations

import numpy as np
import torch

from stagemesh.core.errors import StagemeshError
from stagemesh.v1 import common_pb2

_DTYPES = {
    name: getattr(torch, name)
    for name in ("float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool")
}


def tensor_to_pb(t: torch.Tensor) -> common_pb2.Tensor:
    t = t.detach().contiguous().cpu()
    name = str(t.dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise StagemeshError(f"dtype {name} cannot cross the wire")
    # view as bytes (bfloat16 has no numpy dtype)
    data = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return common_pb2.Tensor(dtype=name, shape=list(t.shape), data=data)


def tensor_from_pb(msg: common_pb2.Tensor, device: str | torch.device = "cpu") -> torch.Tensor:
    dtype = _DTYPES.get(msg.dtype)
    if dtype is None:
        raise StagemeshError(f"unknown tensor dtype {msg.dtype!r} on the wire")
    shape = tuple(msg.shape)
    itemsize = torch.empty((), dtype=dtype).element_size()
    expected = int(np.prod(shape, dtype=np.int64)) * itemsize if shape else itemsize
    if len(msg.data) != expected:
        raise StagemeshError(f"tensor of shape {shape} {msg.dtype} needs {expected} bytes, got {len(msg.data)}")
    if expected == 0:
        return torch.empty(shape, dtype=dtype, device=device)
    raw = torch.frombuffer(bytearray(msg.data), dtype=torch.uint8)
    return raw.view(dtype).reshape(shape).to(device)
