"""compressed-tensors (llm-compressor's checkpoints): config_groups of QuantizationArgs over the linears their
`targets` name, minus `ignore`. Built:
- float-quantized: FP8 weights (float8_e4m3fn) with a scale per tensor, per output channel or per block
  (`strategy` tensor / channel / block), `weight_scale`;
- int-quantized: INT8 weights, symmetric, the same scales (W8A8's);
- pack-quantized: 4- or 8-bit symmetric integers packed eight (four) to an int32 along K (`weight_packed`,
  offset by 2^(bits-1)), `weight_scale` per group of `group_size` columns or per channel, `weight_shape`
  (W4A16's).
Activations (`input_activations`): none, dynamic (per token: the products are weight-only and exact; the int8
fast path is a choice of the kernels, --quantization-activations), or static per tensor with `input_scale`
(x rounded with it to the format before the product, as the checkpoint's kernels do)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from stage_worker.quant_methods.method import (Part, QuantMethod, channel_scales, check_scales, expect_shape, field,
                                               matches, refuse, rows_of, scalar)
from stage_worker.quant_methods.packing import unpack_int32

NAME = "compressed-tensors"
FORMATS = ("float-quantized", "int-quantized", "pack-quantized")
ARGS = frozenset({"num_bits", "type", "symmetric", "group_size", "strategy", "block_structure", "dynamic", "actorder",
                  "observer", "observer_kwargs", "scale_dtype", "zp_dtype"})  # (observers: how it was calibrated)


@dataclass(frozen=True)
class Scheme:
    targets: tuple[str, ...]
    format: str
    bits: int
    type: str  # "float" / "int"
    strategy: str  # "tensor" / "channel" / "group" / "block"
    group_size: int | None
    block: tuple[int, int] | None
    activation: str | None  # static activations: "fp8" / "int8"; None: none or dynamic


def _args(group: str, kind: str, args: dict[str, Any]) -> dict[str, Any]:
    if not isinstance(args, dict):
        raise refuse(NAME, f"config_groups.{group}.{kind} must be an object")
    unknown = sorted(set(args) - ARGS)
    if unknown:
        raise refuse(NAME, f"config_groups.{group}.{kind}.{unknown[0]} is not honoured by stagemesh")
    return args


def _scheme(group: str, spec: dict[str, Any], default_format: str | None) -> Scheme:
    where = f"config_groups.{group}"
    unknown = sorted(set(spec) - {"targets", "weights", "input_activations", "output_activations", "format"})
    if unknown:
        raise refuse(NAME, f"{where}.{unknown[0]} is not honoured by stagemesh")
    if spec.get("output_activations") is not None:
        raise refuse(NAME, f"{where}.output_activations (quantised outputs) is not built")
    fmt = field({"format": spec.get("format") or default_format}, NAME, "format", FORMATS)
    w = _args(group, "weights", spec.get("weights") or {})
    bits = field(w, NAME, "num_bits", (4, 8))
    kind = field(w, NAME, "type", ("int", "float"))
    strategy = field(w, NAME, "strategy", ("tensor", "channel", "group", "block"))
    field(w, NAME, "symmetric", (True,))
    field(w, NAME, "dynamic", (False,))
    field(w, NAME, "actorder", (None,))
    if (kind == "float") != (fmt == "float-quantized") or (kind == "float" and bits != 8) or \
            (fmt == "int-quantized" and bits != 8):
        raise refuse(NAME, f"{where}: {kind} weights of {bits} bits in format {fmt} are not built")
    group_size = w.get("group_size")
    if strategy == "group" and not (isinstance(group_size, int) and group_size > 0):
        raise refuse(NAME, f"{where}.weights.group_size = {group_size!r} must be a positive integer")
    block = w.get("block_structure")
    if strategy == "block" and not (isinstance(block, list) and len(block) == 2):
        raise refuse(NAME, f"{where}.weights.block_structure = {block!r} must be [rows, columns]")
    shape = (int(block[0]), int(block[1])) if strategy == "block" and block is not None else None
    return Scheme(tuple(spec.get("targets") or ()), fmt, bits, kind, strategy, group_size, shape,
                  _activation(where, spec.get("input_activations")))


def _activation(where: str, args: dict[str, Any] | None) -> str | None:
    if args is None:
        return None
    a = _args(where.split(".")[-1], "input_activations", args)
    field(a, NAME, "num_bits", (8,))
    kind = field(a, NAME, "type", ("int", "float"))
    field(a, NAME, "symmetric", (True,))  # (asymmetric activations carry an input_zero_point: not built)
    dynamic = field(a, NAME, "dynamic", (True, False))
    field(a, NAME, "strategy", ("token",) if dynamic else ("tensor",))
    return None if dynamic else ("fp8" if kind == "float" else "int8")


class CompressedTensors(QuantMethod):
    name = NAME
    fields = frozenset({"config_groups", "format", "ignore", "kv_cache_scheme", "quantization_status",
                        "sparsity_config", "transform_config", "global_compression_ratio", "version"})

    def __init__(self, qc):
        super().__init__(qc)
        field(qc, NAME, "quantization_status", ("compressed",), "compressed")
        # (kv_cache_scheme is the fp8 KV cache's: stage_worker.kv_scales checks it and reads its scales)
        for key in ("sparsity_config", "transform_config"):
            if qc.get(key):
                raise refuse(NAME, f"{key} is not built (stagemesh reads quantised weights only)")
        groups = qc.get("config_groups")
        if not isinstance(groups, dict) or not groups:
            raise refuse(NAME, "config_groups must name at least one group")
        self.schemes = [_scheme(g, spec, qc.get("format")) for g, spec in groups.items()]
        self.ignore = list(qc.get("ignore") or [])
        self.bits = min(s.bits for s in self.schemes)

    @property
    def plan_dtype(self) -> str:
        if self.bits == 4:
            return "int4"
        return "fp8" if any(s.type == "float" for s in self.schemes) else "int8"

    def scheme(self, prefix: str) -> Scheme | None:
        if matches(self.ignore, prefix):
            return None
        named = [s for s in self.schemes if matches([t for t in s.targets if t != "Linear"], prefix)]
        found = named or [s for s in self.schemes if "Linear" in s.targets]
        return found[0] if found else None

    def quantised(self, prefix, reader):
        return self.scheme(prefix) is not None

    def read(self, reader, prefix, dim, start, length):
        s = self.scheme(prefix)
        assert s is not None, "read only what quantised() says is quantised"
        part = (self._packed if s.format == "pack-quantized" else self._plain)(s, reader, prefix, dim, start, length)
        if s.activation is not None:
            name = f"{prefix}.input_scale"
            if not reader.has(name):
                raise refuse(NAME, f"static input_activations need {name}, which the checkpoint lacks")
            part.activation, part.input_scale = s.activation, scalar(NAME, name, reader.read_whole(name))
        return part

    def _plain(self, s: Scheme, reader, prefix, dim, start, length) -> Part:
        name = f"{prefix}.weight"
        total_rows, width = reader.shape(name)
        q = reader.read_slice(name, dim, start, length)
        want = torch.float8_e4m3fn if s.type == "float" else torch.int8
        if q.dtype != want:
            raise refuse(NAME, f"{name} is stored as {q.dtype}; config_groups say {want}")
        if reader.has(f"{prefix}.weight_zero_point"):  # written as zeros for symmetric weights by some versions
            _zero(reader, f"{prefix}.weight_zero_point")
        gid, scales = self._scales(s, reader, prefix, dim, start, length, total_rows, width)
        return Part(q, gid, scales, None, 8, f"compressed-tensors {'fp8' if s.type == 'float' else 'int8'} "
                                            f"{s.strategy}")

    def _packed(self, s: Scheme, reader, prefix, dim, start, length) -> Part:
        name = f"{prefix}.weight_packed"
        shape = reader.read_whole(f"{prefix}.weight_shape").tolist()
        total_rows, width = shape
        per = 32 // s.bits
        expect_shape(NAME, name, reader.shape(name), [total_rows, -(-width // per)])
        if dim == 1 and (start % per or length % per):
            raise refuse(NAME, f"{name}: a TP shard of columns {start}:{start + length} splits its int32 words")
        words = (start // per, length // per) if dim == 1 else (start, length)
        packed = reader.read_slice(name, dim, *words)
        codes = unpack_int32(packed, s.bits, 1)[:, :length if dim == 1 else width]
        gid, scales = self._scales(s, reader, prefix, dim, start, length, total_rows, width)
        offset = 1 << (s.bits - 1)
        if s.bits == 8:
            return Part((codes.to(torch.int16) - offset).to(torch.int8), gid, scales, None, 8,
                        f"compressed-tensors int8 {s.strategy}")
        zeros = torch.full_like(scales, float(offset))
        return Part(codes, gid, scales, zeros, 4, f"compressed-tensors int4 {s.strategy}"
                                                  f"{f' g{s.group_size}' if s.group_size else ''}")

    def _scales(self, s: Scheme, reader, prefix, dim, start, length, total_rows, width):
        """Each column's group and each row's scales of them, for the slice read."""
        name = f"{prefix}.weight_scale"
        rows = rows_of(dim, start, length, total_rows)
        cols = torch.arange(length if dim == 1 else width) + (start if dim == 1 else 0)
        if s.strategy in ("tensor", "channel"):
            if s.strategy == "tensor" and reader.shape(name) not in ([], [1]):
                raise refuse(NAME, f"{name} has shape {reader.shape(name)}; strategy 'tensor' stores one scale")
            return torch.zeros_like(cols), channel_scales(NAME, reader, name, rows, total_rows)
        if s.strategy == "group":
            assert s.group_size is not None
            expect_shape(NAME, name, reader.shape(name), [total_rows, -(-width // s.group_size)])
            scales = reader.read_slice(name, 0, *rows).float()
            check_scales(NAME, name, scales)
            return cols // s.group_size, scales
        assert s.block is not None
        bn, bk = s.block
        expect_shape(NAME, name, reader.shape(name), [-(-total_rows // bn), -(-width // bk)])
        blocks = reader.read_whole(name).float()
        check_scales(NAME, name, blocks)
        return cols // bk, blocks[(torch.arange(rows[1]) + rows[0]) // bn]


def _zero(reader, name: str) -> None:
    if reader.read_whole(name).any():
        raise refuse(NAME, f"{name} holds non-zero zero points; the config says symmetric weights")


METHOD = CompressedTensors
