"""fp8 (vLLM's Fp8Config, transformers' FineGrainedFP8Config): float8_e4m3fn weights, either
- with `weight_block_size` [bn, bk] (DeepSeek-V3's): `weight_scale_inv` [ceil(N / bn), ceil(K / bk)], one
  float32 scale (a multiplier, despite its name) per block of bn rows by bk columns; activations dynamic;
- or without: `weight_scale` per tensor (or per output channel), activations dynamic, or static with
  `input_scale` (activation_scheme "static": x rounded to fp8 with it before the product, as the format does).
Dynamic activations are not rounded: the products are weight-only, as vLLM's Marlin fp8 path.
`--quantization fp8` with an unquantised checkpoint quantises it at load instead (stage_worker.quantization)."""
from __future__ import annotations

import torch

from stage_worker.quant_methods.method import (Part, QuantMethod, channel_scales, check_scales, field, matches,
                                               read_fp8, refuse, rows_of, scalar)


class Fp8(QuantMethod):
    name = "fp8"
    fields = frozenset({"activation_scheme", "fmt", "weight_block_size", "modules_to_not_convert",
                        "ignored_layers"})

    def __init__(self, qc):
        super().__init__(qc)
        field(qc, self.name, "fmt", ("e4m3",), "e4m3")
        self.static = field(qc, self.name, "activation_scheme", ("dynamic", "static"), "dynamic") == "static"
        block = qc.get("weight_block_size")
        if block is not None:
            if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
                raise refuse(self.name, f"weight_block_size = {block!r} must be [rows, columns]")
            if self.static:
                raise refuse(self.name, "activation_scheme 'static' with weight_block_size is not built (block fp8 "
                                        "checkpoints quantise activations dynamically)")
        self.block = block
        self.skip = list(qc.get("modules_to_not_convert") or []) + list(qc.get("ignored_layers") or [])

    plan_dtype = "fp8"

    def quantised(self, prefix, reader):
        return prefix != "lm_head" and not matches(self.skip, prefix)

    def read(self, reader, prefix, dim, start, length):
        total_rows, width = reader.shape(f"{prefix}.weight")
        q = read_fp8(self.name, reader, f"{prefix}.weight", dim, start, length)
        rows = rows_of(dim, start, length, total_rows)
        if self.block is not None:
            return self._block(reader, prefix, q, dim, start, rows, total_rows, width)
        s = channel_scales(self.name, reader, f"{prefix}.weight_scale", rows, total_rows)
        part = Part(q, torch.zeros(q.shape[1], dtype=torch.int64), s, None, 8, "fp8")
        if self.static:
            name = f"{prefix}.input_scale"
            if not reader.has(name):
                raise refuse(self.name, f"activation_scheme 'static' needs {name}, which the checkpoint lacks")
            part.activation, part.input_scale = "fp8", scalar(self.name, name, reader.read_whole(name))
        return part

    def _block(self, reader, prefix, q, dim, start, rows, total_rows, width) -> Part:
        bn, bk = self.block
        name = f"{prefix}.weight_scale_inv"
        want = [-(-total_rows // bn), -(-width // bk)]
        if reader.shape(name) != want:
            raise refuse(self.name, f"{name} has shape {reader.shape(name)}; weight_block_size {self.block} of a "
                                    f"[{total_rows}, {width}] weight wants {want}")
        inv = reader.read_whole(name).float()
        check_scales(self.name, name, inv)
        first = start if dim == 1 else 0
        gid = (torch.arange(q.shape[1]) + first) // bk
        scales = inv[(torch.arange(rows[1]) + rows[0]) // bn]  # each row's blocks
        return Part(q, gid, scales, None, 8, f"fp8 block {bn}x{bk}")


METHOD = Fp8
