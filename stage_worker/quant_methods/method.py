"""What a checkpoint quantization method declares (one module each in this package): the fields of its
quantization_config it honours, which linears it quantises, and how one TP shard of a quantised linear is
read from the checkpoint as its quantizer wrote it (a Part, which stage_worker.quant_methods.layout turns
into the kernels' layout).

Every field a method does not list is refused at start-up by name; so is every value it does not build.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from stagemesh.core.errors import StagemeshError


@dataclass
class Part:
    """One shard of a quantised linear, read and unpacked (1 byte a weight at most: never its float copy).

    w[r, c] = scales[r, gid[c]] * (q[r, c] - zeros[r, gid[c]])   (zeros None: 0)
    q: [rows, cols] uint8 codes 0..15 (4-bit), int8 (8-bit) or float8_e4m3fn; gid: int64 [cols], each
    column's group; scales / zeros: fp32 [rows, groups]. `input_scale`: a static activation scale (the
    product sees x as the checkpoint's activation quantization rounds it: `activation`)."""

    q: torch.Tensor
    gid: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    bits: int
    kind: str  # what it was read as, for the stage's start-up line ("fp8 channel", "gptq int4 g128", ...)
    activation: str | None = None  # static activations: "fp8" or "int8" (rounded with input_scale); None: as they are
    input_scale: float | None = None
    input_bound: float | None = None  # fbgemm's activation_scale_ub: |x| clamped to it before the product

    def dequantised(self, dtype: torch.dtype) -> torch.Tensor:
        """W [rows, cols] in `dtype`: the numbers the format means (for the few weights a layer reads dense, as
        MLA's kv_b_proj; a linear's product runs on the quants)."""
        w = self.q.float()
        if self.zeros is not None:
            w -= self.zeros[:, self.gid]
        return (w * self.scales[:, self.gid]).to(dtype)


def refuse(method: str, what: str) -> StagemeshError:
    return StagemeshError(f"quantization_config ({method}): {what}")


class QuantMethod:
    """A quant_method of config.json's quantization_config. Subclasses set `name` and `fields` (every key of
    the config they honour or know to carry no meaning for inference), parse the config in __init__ and
    implement quantised() and read()."""

    name: ClassVar[str]
    fields: ClassVar[frozenset[str]]
    bits: int = 8  # the weights' bits
    # built for one family's layers only: served where the family names it (Family.own_quant_methods)
    family_only: ClassVar[bool] = False

    @property
    def plan_dtype(self) -> str:
        """The weights' format as `stagemesh plan --dtype` counts it (stagemesh.entry.plan.memory.DTYPE_BYTES)."""
        return "int4" if self.bits == 4 else "int8"

    def __init__(self, qc: dict[str, Any]):
        self.qc = qc
        unknown = sorted(set(qc) - self.fields - {"quant_method"})
        if unknown:
            raise refuse(self.name, f"field {unknown[0]!r} is not honoured by stagemesh (it knows "
                                    f"{', '.join(sorted(self.fields))})")

    def quantised(self, prefix: str, reader) -> bool:
        """Whether the linear `prefix` (model.layers.0.self_attn.q_proj, lm_head, ...) is stored quantised."""
        raise NotImplementedError

    def read(self, reader, prefix: str, dim: int, start: int, length: int) -> Part:
        """The slice start:start+length along `dim` (0: output rows, 1: input columns) of W [N, K] = prefix's."""
        raise NotImplementedError

    def describe(self) -> str:
        return self.name


def field(qc: dict[str, Any], method: str, key: str, allowed: tuple, default: Any = None) -> Any:
    """qc[key], refused by name unless one of `allowed`."""
    value = qc.get(key, default)
    if value not in allowed:
        raise refuse(method, f"{key} = {value!r} is not built (stagemesh takes {', '.join(map(repr, allowed))})")
    return value


def matches(patterns, prefix: str) -> bool:
    """Whether a module name matches one of an ignore list's entries: 're:<regex>' (re.match, as
    compressed-tensors and vLLM do), else the name itself or a name it ends with at a dot (transformers'
    modules_to_not_convert: 'lm_head' matches lm_head, 'mlp.gate' every layer's router)."""
    for p in patterns or ():
        if p.startswith("re:"):
            if re.match(p[3:], prefix):
                return True
        elif prefix == p or prefix.endswith("." + p) or f".{p}." in f".{prefix}.":
            return True
    return False


def columns_of(dim: int, start: int, length: int, width: int) -> tuple[int, int]:
    """The input columns (start, count) a read takes: its slice along dim 1, else all `width`."""
    return (start, length) if dim == 1 else (0, width)


def rows_of(dim: int, start: int, length: int, rows: int) -> tuple[int, int]:
    return (start, length) if dim == 0 else (0, rows)


def expect_shape(method: str, name: str, got, want) -> None:
    if list(got) != list(want):
        raise refuse(method, f"{name} has shape {list(got)}; the config and the weight's shape want {list(want)}")


def scalar(method: str, name: str, t: torch.Tensor) -> float:
    """A per-tensor scale, stored as [] or [1]."""
    if t.numel() != 1:
        raise refuse(method, f"{name} has shape {list(t.shape)}; a per-tensor scale is one number")
    value = float(t.float().reshape(()))
    check_scales(method, name, torch.tensor([value]))
    return value


def check_scales(method: str, name: str, scales: torch.Tensor) -> None:
    """Scales that are not finite, or negative, make every product garbage: refused with the tensor named."""
    if not torch.isfinite(scales).all() or (scales < 0).any():
        raise refuse(method, f"{name} holds non-finite or negative scales (a corrupt checkpoint)")


def read_fp8(method: str, reader, name: str, dim: int, start: int, length: int) -> torch.Tensor:
    """A slice of a float8_e4m3fn weight, refused by name when stored otherwise."""
    q = reader.read_slice(name, dim, start, length)
    if q.dtype != torch.float8_e4m3fn:
        raise refuse(method, f"{name} is stored as {q.dtype}; the config says float8_e4m3fn")
    return q


def channel_scales(method: str, reader, name: str, rows: tuple[int, int], total_rows: int) -> torch.Tensor:
    """fp32 [rows, 1] of a scale stored per output channel ([N, 1] or [N]) or per tensor ([] or [1])."""
    shape = reader.shape(name)
    if shape in ([], [1]):
        return torch.full((rows[1], 1), scalar(method, name, reader.read_whole(name)))
    if shape not in ([total_rows, 1], [total_rows]):
        raise refuse(method, f"{name} has shape {shape}; a scale per channel of {total_rows} rows is "
                             f"[{total_rows}, 1], per tensor []")
    s = reader.read_slice(name, 0, rows[0], rows[1]).float().reshape(-1, 1)
    check_scales(method, name, s)
    return s
