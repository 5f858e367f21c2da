"""The parts of a (merged) quantised layer, each read as its quantizer wrote it, laid out for the kernels
(stage_worker.quant_methods.layout) and stacked in the layer's order as one QuantizedWeight: what the loader does
for a linear and stage_worker.quant_methods.experts for each expert."""
from __future__ import annotations

import torch

from stagemesh.core.errors import StagemeshError
from stage_worker.quant_methods.layout import layout
from stage_worker.quant_methods.method import Part
from stage_worker.quant_weight import InputTransform, QuantizedWeight


def assemble(name: str, rows: int, width: int, parts: list[tuple[int, Part]]) -> QuantizedWeight:
    """The parts of a (merged) layer, in their rows' order, as one weight of the layer's shape."""
    parts = sorted(parts, key=lambda p: p[0])
    laid = [layout(p) for _, p in parts]
    first = parts[0][1]
    orders = [lt.columns for lt in laid]
    if len({(lt.qs.dtype, lt.scales.shape[1]) for lt in laid}) > 1 or not _same(orders):
        kinds = ", ".join(p.kind for _, p in parts)
        raise StagemeshError(f"{name}: its parts are stored in different layouts ({kinds}, or different g_idx); "
                             "stagemesh runs a merged layer in one")
    if len({(p.activation, p.input_bound) for _, p in parts}) > 1:
        raise StagemeshError(f"{name}: its parts quantise their activations differently; stagemesh runs a merged "
                             "layer in one way")
    qs = torch.cat([lt.qs for lt in laid])
    scales = torch.cat([lt.scales for lt in laid])
    mins = None if laid[0].mins is None else torch.cat([lt.mins for lt in laid if lt.mins is not None])
    got = qs.shape[0]
    if got > rows:
        raise StagemeshError(f"{name}: the checkpoint gives {got} rows, the config wants {rows}")
    if got < rows:  # the vocabulary's padding rows of the last TP rank: zeros
        pad = rows - got
        qs = torch.cat([qs, qs.view(torch.uint8).new_zeros(pad, qs.shape[1]).view(qs.dtype)])
        scales = torch.cat([scales, scales.new_zeros(pad, scales.shape[1])])
        mins = None if mins is None else torch.cat([mins, mins.new_zeros(pad, mins.shape[1])])
    # static activation scales of a merged layer: the largest (vLLM's rule; a quantizer's q, k and v see one input)
    scales_in = [p.input_scale for _, p in parts if p.input_scale is not None]
    inputs = InputTransform(width, laid[0].columns, first.activation, max(scales_in) if scales_in else None,
                            first.input_bound)
    plain = inputs.columns is None and inputs.activation is None and inputs.input_bound is None
    qw = QuantizedWeight(qs, scales, mins, first.kind, inputs=None if plain else inputs)
    if qw.shape != (rows, width):
        raise StagemeshError(f"{name}: the checkpoint gives {list(qw.shape)}, the config wants {[rows, width]}")
    return qw


def _same(orders: list[torch.Tensor | None]) -> bool:
    """Whether the parts of a merged layer gather x's columns alike (desc_act's g_idx: one input, one order)."""
    first = orders[0]
    return all(o is None for o in orders) if first is None else \
        all(o is not None and torch.equal(o, first) for o in orders)
