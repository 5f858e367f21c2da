"""A quantised weight in a layer's place: its packed quants and scales (kernels/quant_reference.py's
layouts), as a linear product or an embedding's row lookup."""
from __future__ import annotations

import torch
from torch import nn

import kernels


class QuantizedWeight(nn.Module):
    """W [rows, K]; `int8_activations`: the product quantises x per row and group too (W8A8)."""

    def __init__(self, qs: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, kind: str,
                 int8_activations: bool = False):
        super().__init__()
        # plain attributes, not buffers: every product reads them, and a buffer is a lookup through
        # nn.Module.__getattr__ (~0.5 us each); _apply moves them as it would move buffers (.to(device))
        self.qs = qs.contiguous()
        self.scales = scales.float().contiguous()
        self.mins = None if mins is None else mins.float().contiguous()
        self.kind = kind  # what it was read as (Q4_1, Q8_0, int8, ...), for the logs
        self.int8_activations = int8_activations

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
        self.qs, self.scales = fn(self.qs), fn(self.scales)
        self.mins = None if self.mins is None else fn(self.mins)
        return self

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qs, self.scales, self.mins) if t is not None)

    def extra_repr(self) -> str:
        return f"{self.kind}, shape={self.shape}, groups={self.scales.shape[1]}, a8={self.int8_activations}"
