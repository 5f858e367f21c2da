"""--quantization-activations: how a stage's quantised integer weights (GGUF, GPTQ, AWQ, compressed-tensors
INT8 / W4A16, w8a16) multiply on CPU. exact: weight-only, the activations in fp32 / bf16, so every product is
the dequantised model's (the tokens are transformers' on the dequantised weights); int8: the activations
quantised to int8 per row and block of 32 whatever the weights' group (llama.cpp's q8 blocks; a 4-bit
weight's min meets the quantised block sums, as q8_1's) and the products run on integers (vpdpbusd where the
CPU has VNNI).

int8 is allowed only under the measured contract (docs/quantization.md, benchmarks/bench_quant_contract.py,
tests/test_quant_contract.py): over an evaluation text its KL divergence from the exact path is at most 0.1x the
KL divergence the weight quantization adds against bf16, and its top-1 token agrees with exact at >= 99%. A
format whose measurement meets it is in ALLOWED_INT8 and may make int8 its default (DEFAULT_INT8); for the others
int8 is refused, naming the measurement. Measured on the default model (benchmarks/RESULTS.md, 2026-11-29, blocks
of 32): GGUF Q4_1 KL ratio 3.30, top-1 98.8%; INT8 W8A8 KL ratio 0.56, top-1 99.2%: neither meets it, so none is
allowed yet. fp8 weights are not integers, and weights whose checkpoint quantises activations statically keep
that: both stay exact. (--quantization w8a8 is int8 by its name, as before the contract.)"""
from __future__ import annotations

import torch
from torch import nn

from stagemesh.core.errors import StagemeshError
from stage_worker.quant_weight import QuantizedWeight

# the --quantization methods (or checkpoints' quant_method) whose int8 path met the contract (RESULTS.md), and
# those of them that make it their default on CPU
ALLOWED_INT8: frozenset[str] = frozenset()
DEFAULT_INT8: frozenset[str] = frozenset()
MEASURED = "GGUF Q4_1: KL ratio 3.30, top-1 98.8%; INT8 W8A8: 0.56, 99.2% (benchmarks/RESULTS.md)"


def integer_weights(model: nn.Module) -> list[QuantizedWeight]:
    """The quantised weights the int8 path can take: integer quants, activations not statically quantised."""
    return [m for m in model.modules() if isinstance(m, QuantizedWeight) and m.qs.dtype in (torch.int8, torch.uint8)
            and (m.inputs is None or m.inputs.activation is None)]


def check_allowed(requested: str | None, quantization: str | None) -> None:
    """Refuse int8 activations for a format whose measurement misses the contract (serve asks before starting)."""
    if requested == "int8" and quantization != "w8a8" and quantization not in ALLOWED_INT8:
        raise StagemeshError(f"--quantization-activations int8 is not allowed for {quantization or 'this model'}: the "
                             "int8 path misses the accuracy contract (KL from the exact path <= 0.1x the weights' own, "
                             f"top-1 >= 99%; measured {MEASURED}); the exact path serves it")


def choose_activations(model: nn.Module, requested: str | None, quantization: str | None, device) -> str | None:
    """Set the int8 path on the model's weights where asked (or by default); the mode the stage runs (None: it
    holds no quantised weights)."""
    weights = integer_weights(model)
    if quantization == "w8a8":  # its name is its activations
        if requested == "exact":
            raise StagemeshError("--quantization w8a8 quantises the activations; --quantization-activations exact "
                                 "contradicts it (w8a16 is its weight-only form)")
        return "int8"
    if not any(isinstance(m, QuantizedWeight) for m in model.modules()):
        if requested is not None:
            raise StagemeshError(f"--quantization-activations {requested}: the model holds no quantised weights")
        return None
    mode = requested or ("int8" if quantization in DEFAULT_INT8 and torch.device(device).type == "cpu" else "exact")
    if mode == "int8":
        check_allowed(mode, quantization)
        if torch.device(device).type != "cpu":
            raise StagemeshError("--quantization-activations int8 is built for CPU stages only")
        if not weights:
            raise StagemeshError("--quantization-activations int8 takes integer weights; this model's are fp8 (or "
                                 "quantise their activations statically): they stay exact")
        for w in weights:
            w.int8_activations = True
    return mode
