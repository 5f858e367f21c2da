"""--quantization: linear weights held quantised (stage_worker.quant_weight) and multiplied by
kernels/csrc/quant_linear.cpp on CPU stages, by kernels/triton_quant.py (weight-only) on CUDA.

- gguf: the weights of a GGUF file as they are (Q4_0, Q4_1, Q4_K, Q8_0; the embedding table and LM head
  too, when the file has them quantised), read slice by slice (stage_worker.gguf); the activations stay
  fp32 / bf16, so every product is the dequantised model's.
- w8a16 / w8a8: int8 weights with a scale per output channel, quantised at load from an fp32 / bf16
  checkpoint (embeddings and LM head stay in --dtype); w8a8 also quantises the activations to int8 per
  token (dynamic scales) and multiplies on integers (CPU stages).
- fp8: float8_e4m3fn weights with a scale per output channel, quantised at load (CUDA stages), the
  activations in --dtype: weight-only, as vLLM's fp8 on GPUs without fp8 tensor cores (its W8A8 fp8
  products with dynamic activation scales on Hopper are not built).
"""
from __future__ import annotations

import torch
from torch import nn

from kernels.quant_reference import quantize_fp8_per_channel, quantize_int8_per_channel
from stagemesh.core.errors import StagemeshError
from stagemesh.core.model_config import ModelConfig
from stage_worker.layers import Linear, ParallelLMHead, VocabParallelEmbedding, shards_of
from stage_worker.quant_methods import checkpoint_method
from stage_worker.quant_methods.method import QuantMethod
from stage_worker.quant_weight import QuantizedWeight

METHODS = ("gguf", "w8a16", "w8a8", "fp8")  # quantised at load (or a GGUF's); checkpoints': stage_worker.quant_methods


def check_quantization(method: str | None, cfg: ModelConfig, device) -> QuantMethod | None:
    """Refuse, by name, what is not built; the checkpoint's own quantization method (its quantization_config),
    or None."""
    checkpoint = checkpoint_method(cfg, None if method == "gguf" else method)
    if checkpoint is not None:
        return checkpoint
    if method is None:
        return None
    if method not in METHODS:
        raise StagemeshError(f"--quantization {method!r} is not built; stagemesh has {', '.join(METHODS)} "
                             "(gguf: a .gguf file's weights; w8a16 / w8a8: int8 weights quantised at load; "
                             "fp8: fp8 weights quantised at load, CUDA)")
    cuda = str(device).startswith("cuda")
    if cuda and method == "w8a8":
        raise StagemeshError("--quantization w8a8 (int8 activations) is built for CPU stages only; on --device cuda "
                             "the weights alone are quantised: w8a16 (int8), fp8 or gguf")
    if not cuda and method == "fp8":
        raise StagemeshError("--quantization fp8 is built for CUDA stages only (Triton, weight-only); CPU stages "
                             "take w8a16, w8a8 or gguf")
    if cfg.is_moe:
        raise StagemeshError(f"--quantization {method} with a mixture-of-experts model ({cfg.model_type}) is not "
                             "built: the experts' kernels take dense weights")
    return None


def _swap(module: nn.Module, weight: QuantizedWeight) -> None:
    dense = module.weight
    assert isinstance(dense, torch.Tensor), "only a dense parameter is swapped for a quantised weight"
    device = dense.device
    del module.weight  # the dense parameter goes
    module.weight = weight.to(device)


def _assemble(name: str, rows: int, width: int, parts: list) -> QuantizedWeight:
    """The shards read from the file, stacked in their parameter's order and checked against its shape."""
    kinds = {(qs.dtype, scales.shape[1], mins is None, kind) for _, qs, scales, mins, kind in parts}
    if len(kinds) > 1:
        raise StagemeshError(f"{name}: its parts are stored as {sorted(k[3] for k in kinds)} in the GGUF; "
                             "stagemesh runs a merged layer (q/k/v, gate/up) in one format")
    parts.sort(key=lambda p: p[0])
    qs = torch.cat([p[1] for p in parts])
    scales, mins = torch.cat([p[2] for p in parts]), None if parts[0][3] is None else torch.cat([p[3] for p in parts])
    qw = QuantizedWeight(qs, scales, mins, parts[0][4])
    got_rows, got_width = qw.shape
    if got_width != width or got_rows > rows:
        raise StagemeshError(f"{name}: the GGUF gives [{got_rows}, {got_width}], the config wants [{rows}, {width}]")
    if got_rows < rows:  # the vocabulary's padding rows of the last TP rank: zeros
        pad = rows - got_rows
        qw = QuantizedWeight(torch.cat([qs, qs.new_zeros(pad, qs.shape[1])]),
                             torch.cat([scales, scales.new_zeros(pad, scales.shape[1])]),
                             None if mins is None else torch.cat([mins, mins.new_zeros(pad, mins.shape[1])]),
                             parts[0][4])
    return qw


def load_gguf(model: nn.Module, ckpt) -> None:
    """Every weight the GGUF holds quantised goes into its layer as is; the rest (norms, biases, dense
    tensors) fill the parameters through the checkpoint's dense reads."""
    from stage_worker.weights import load_weights

    for name, module in model.named_modules():
        if not isinstance(module, (Linear, ParallelLMHead, VocabParallelEmbedding)):
            continue
        weight = module.weight
        if isinstance(weight, QuantizedWeight) or not any(ckpt.is_quantised(s.name) for s in shards_of(weight)):
            continue
        parts = []
        for shard in shards_of(weight):
            if not ckpt.is_quantised(shard.name):
                raise StagemeshError(f"{name}: {shard.name} is {ckpt.qtype(shard.name)} in the GGUF and the other "
                                     "parts are quantised; stagemesh runs a merged layer in one format")
            qs, scales, mins = ckpt.read_quantised(shard.name, shard.dim, shard.start, shard.length)
            parts.append((shard.dest, qs, scales, mins, ckpt.qtype(shard.name)))
        _swap(module, _assemble(name, weight.shape[0], weight.shape[1], parts))
    load_weights(model, ckpt)


def quantize_at_load(model: nn.Module, method: str) -> None:
    """w8a16 / w8a8 / fp8: every attention and MLP linear of the loaded model, a scale per output channel."""
    for name, module in model.named_modules():
        if not isinstance(module, Linear) or isinstance(module.weight, QuantizedWeight):
            continue
        width = module.weight.shape[1]
        if width % 32:
            raise StagemeshError(f"--quantization {method}: {name} has {width} inputs on this rank; the quantised "
                                 "kernels take multiples of 32")
        kind, quantise = ("fp8", quantize_fp8_per_channel) if method == "fp8" else ("int8", quantize_int8_per_channel)
        qs, scales = quantise(module.weight.data)
        _swap(module, QuantizedWeight(qs, scales, None, kind, method == "w8a8"))


def describe(model: nn.Module) -> str:
    """What the stage holds quantised, for its start-up line: formats and bytes."""
    kinds: dict[str, int] = {}
    for module in model.modules():
        if isinstance(module, QuantizedWeight):
            kinds[module.kind] = kinds.get(module.kind, 0) + 1
    total = sum(m.nbytes() for m in model.modules() if isinstance(m, QuantizedWeight))
    listed = ", ".join(f"{n} x {k}" for k, n in sorted(kinds.items()))
    return f"{listed} ({total / 2**20:.1f} MiB quantised)" if kinds else "nothing quantised"
