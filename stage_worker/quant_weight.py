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
                 int8_activations: bool = False, compact_scales: bool = True, inputs: InputTransform | None = None):
        super().__init__()
        # how x reaches the kernel: its columns reordered (GPTQ's desc_act), its static activation quantization
        # (stage_worker.quant_methods); None: as it is
        self.inputs = inputs
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
        """[rows, K]: K the inputs the layer takes (the kernel's may be more: padded columns, `inputs`)."""
        rows, width = self.qs.shape
        if self.inputs is not None and self.inputs.in_features is not None:
            return rows, self.inputs.in_features
        return rows, width * 2 if self.qs.dtype == torch.uint8 else width

    @property
    def plain(self) -> bool:
        """Whether a product is the kernel's call alone (the fused C++ layer may run it: stage_worker.layer_plan)."""
        return self.inputs is None and self.qs.dtype != torch.float8_e4m3fn

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.inputs is not None:
            x = self.inputs(x)
        return kernels.quant_linear(x, self.qs, self.scales, self.mins, bias, self.int8_activations)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The dequantised rows `ids` (an embedding lookup): only those rows are ever dequantised."""
        from kernels.quant_reference import dequantize

        mins = None if self.mins is None else self.mins[ids]
        return dequantize(self.qs[ids], self.scales[ids], mins).to(dtype)

    def _apply(self, fn, recurse=True):
        self.qs = fn(self.qs)
        if self.inputs is not None:
            self.inputs = self.inputs.to(fn)
        self.scales, self.mins = self._stored(fn(self.scales), None if self.mins is None else fn(self.mins))
        return self

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qs, self.scales, self.mins) if t is not None)

    def extra_repr(self) -> str:
        return f"{self.kind}, shape={self.shape}, groups={self.scales.shape[1]}, a8={self.int8_activations}"


class InputTransform:
    """What a checkpoint's format does to x before its product, for the product to be the checkpoint's:
    - columns: x's columns in the order of the kernel's (GPTQ's desc_act groups made contiguous), the index
      in_features meaning a zero column (padding of a group to a multiple of 32);
    - activation "fp8" / "int8" with input_scale: static activation quantization, x rounded as the quantizer's
      kernels round it (x / s to float8_e4m3fn or to int8 saturated, times s), so the product is the format's;
    - input_bound: fbgemm's activation_scale_ub, whose per-row scale never exceeds it: |x| clamped to it."""

    def __init__(self, in_features: int | None = None, columns: torch.Tensor | None = None,
                 activation: str | None = None, input_scale: float | None = None, input_bound: float | None = None):
        self.in_features, self.columns = in_features, columns
        self.activation, self.input_scale, self.input_bound = activation, input_scale, input_bound

    def to(self, fn) -> "InputTransform":
        columns = None if self.columns is None else fn(self.columns)
        return InputTransform(self.in_features, columns, self.activation, self.input_scale, self.input_bound)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_bound is not None:
            x = x.clamp(-self.input_bound, self.input_bound)
        if self.activation is not None and self.input_scale is not None:
            x = static_quantize(x, self.activation, self.input_scale)
        if self.columns is not None:
            x = torch.cat([x, x.new_zeros(*x.shape[:-1], 1)], -1).index_select(-1, self.columns)
        return x


def static_quantize(x: torch.Tensor, activation: str, scale: float) -> torch.Tensor:
    """x as a static per-tensor activation quantization gives it to the product: round(x / s) saturated (int8),
    or x / s cast to float8_e4m3fn saturated (fp8), times s."""
    xf = x.float() / scale
    if activation == "int8":
        q = torch.round(xf).clamp(-128, 127)
    else:
        q = xf.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float()
    return (q * scale).to(x.dtype)
