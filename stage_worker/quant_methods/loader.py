"""A quantised checkpoint's linears into their layers: each shard read as its quantizer wrote it (the method's
read), laid out for the kernels (layout) and stacked in the layer's order as one QuantizedWeight. A weight its
layer reads dense (layers.dequantised_at_load: MLA's kv_b_proj) is dequantised into it once. What the method
leaves dense (ignore lists, norms, embeddings) is filled by the dense loader afterwards."""
from __future__ import annotations

import torch
from torch import nn

from stagemesh.core.errors import StagemeshError
from stage_worker.layers import Linear, ParallelLMHead, is_dequantised_at_load, shards_of
from stage_worker.moe import SparseMoeBlock
from stage_worker.quant_methods.assemble import assemble
from stage_worker.quant_methods.experts import load_experts
from stage_worker.quant_methods.method import QuantMethod
from stage_worker.quant_weight import QuantizedWeight

EMBEDDING = "model.embed_tokens"  # a tied LM head's tensor: an embedding, which no method quantises


def load_quantised(model: nn.Module, method: QuantMethod, reader) -> frozenset[int]:
    """Returns the ids of the dense parameters it filled (the dense loader skips them)."""
    filled = frozenset(id(p) for p in model.parameters()
                       if is_dequantised_at_load(p) and _dequantise(p, method, reader))
    # the routers of experts stay dense, as vLLM keeps them (a quantised one would be refused: fill, coverage)
    routers = {id(m.gate) for m in model.modules() if isinstance(m, SparseMoeBlock)} | \
        {id(m.shared_expert_gate) for m in model.modules() if isinstance(m, SparseMoeBlock)}
    for name, module in list(model.named_modules()):
        if isinstance(module, SparseMoeBlock):
            load_experts(module, method, reader)
        if not isinstance(module, (Linear, ParallelLMHead)) or isinstance(module.weight, QuantizedWeight) or \
                id(module) in routers:
            continue
        shards = shards_of(module.weight)
        prefixes = [s.name.removesuffix(".weight") for s in shards]
        quantised = [p != EMBEDDING and method.quantised(p, reader) for p in prefixes]
        if not any(quantised):
            continue
        if not all(quantised):
            dense = [p for p, q in zip(prefixes, quantised) if not q]
            raise StagemeshError(f"{name}: {', '.join(dense)} is not quantised and the other parts of the merged "
                                 f"layer are ({method.name}); stagemesh runs a merged layer in one format")
        parts = [(s.dest, method.read(reader, p, s.dim, s.start, s.length)) for s, p in zip(shards, prefixes)]
        rows, width = module.weight.shape
        device = module.weight.device
        del module.weight  # the dense parameter goes
        module.weight = assemble(name, rows, width, parts).to(device)  # type: ignore[assignment]
    return filled


def _dequantise(param: torch.Tensor, method: QuantMethod, reader) -> bool:
    """A dense weight's shards read through the method and dequantised in place; False where the checkpoint
    holds them dense (the dense loader fills them then)."""
    shards = shards_of(param)
    prefixes = [s.name.removesuffix(".weight") for s in shards]
    quantised = [method.quantised(p, reader) for p in prefixes]
    if not any(quantised):
        return False
    if not all(quantised):
        raise StagemeshError(f"{', '.join(p for p, q in zip(prefixes, quantised) if not q)} is not quantised and "
                             f"the other parts of its weight are ({method.name})")
    for shard, prefix in zip(shards, prefixes):
        w = method.read(reader, prefix, shard.dim, shard.start, shard.length).dequantised(param.dtype)
        target = (param.data if shard.stack is None else param.data[shard.stack]).narrow(shard.dim, shard.dest,
                                                                                          shard.length)
        if w.shape != target.shape:
            raise StagemeshError(f"{prefix}: the checkpoint gives {list(w.shape)} where the config wants "
                                 f"{list(target.shape)}")
        target.copy_(w)
    return True
