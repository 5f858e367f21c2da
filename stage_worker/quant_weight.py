"""A quantised weight in a layer's place: its packed quants and scales (kernels/quant_reference.py's
layouts), as a linear product or an embedding's row lookup."""
from __future__ import annotations

import torch
from torch import nn

import kernels


class QuantizedWeight(nn.Module):
    """W [rows, K]; `int8_activations`: the product quantises x per row and group too (W8A8).

    On the CPU the scales and mins are kept in fp16 where fp16 holds every one of them exactly (a GGUF's
    Q4_0 / Q4_1 / Q8_0 store them so; Q4_K's and int8's are products of two numbers and stay fp32): the
    kernels widen them exactly, and a 4-bit decode step streams 0.625 bytes a weight instead of 0.75, as
    llama.cpp does (benchmarks/RESULTS.md, 2026-11-26). compact_scales=False keeps fp32 (benchmarks).
    Its tensors are set once: a change is a new QuantizedWeight in the layer's place (the layers see that)."""

    def __init__(self, qs: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, kind: str,
                 int8_activations: bool = False, compact_scales: bool = True):
        super().__init__()
        # plain attributes, not buffers: every product reads them, and a buffer is a lookup through
        # nn.Module.__getattr__ (~0.5 us each); _apply moves them as it would move buffers (.to(device))
        self.qs = qs.contiguous()
        self.compact_scales = compact_scales
        self.scales, self.mins = self._stored(scales, mins)
        self.kind = kind  # what it was read as (Q4_1, Q8_0, int8, ...), for the logs
        self.int8_activations = int8_activations

    def _stored(self, scales: torch.Tensor, mins: torch.Tensor | None):
        """fp16 on the CPU where that is exact (compact_scales), else fp32; contiguous."""
        scales = scales.float().contiguous()
        mins = None if mins is None else mins.float().contiguous()
        if self.compact_scales and scales.is_cpu:
            half = [t.half() for t in (scales, mins) if t is not None]
            if all(torch.equal(h.float(), t) for h, t in zip(half, (scales, mins)) if t is not None):
                return half[0], half[1] if mins is not None else None
        return scales, mins

    @property
    def shape(self) -> tuple[int, int]:
        rows, width = self.qs.shape
        return rows, width * 2 if self.qs.dtype == torch.uint8 else width

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return kernels.quant_linear(x, self.qs, self.scales, self.mins, bias, self.int8_activations)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The dequantised rows `ids` (an embedding lookup): only those rows are ever dequantised."""
        from kernels.quant_reference import dequantize

        mins = None if self.mins is None else self.mins[ids]
        return dequantize(self.qs[ids], self.scales[ids], mins).to(dtype)

    def _apply(self, fn, recurse=True):
        self.qs = fn(self.qs)
        self.scales, self.mins = self._stored(fn(self.scales), None if self.mins is None else fn(self.mins))
        return self

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qs, self.scales, self.mins) if t is not None)

    def extra_repr(self) -> str:
        return f"{self.kind}, shape={self.shape}, groups={self.scales.shape[1]}, a8={self.int8_activations}"
