"""A dense decoder layer as one C++ call (kernels/csrc/decoder_layer.h) on CPU.

A decode step of a small model is mostly Python between kernels: at batch 1 the default model's layer spends
~10 us in Python around ~10 us of C++ calls (products replayed from a cache), and in a real step, where the
weights stream through the caches between calls, that Python runs slower still. The plan makes the same
kernel calls, in the same order with the same arguments, from C++: the same bits, without the Python.

It runs where each of its calls is what the Python layer would call: a DecoderLayer of Attention and MLP (no
per-head q/k norm, no experts) of a family that says the plan covers it (stagemesh.core.families: Family.
fused_cpu_plan), one TP rank, every parameter on the CPU, the C++ kernels built and chosen (kernels.dispatch),
activations in the norms' dtype and the KV cache in it or fp8, an attention family that covers the head dim, no
forward hook on anything inside the layer (hooks on the layer itself still fire). Otherwise the layer's own Python runs.
With LoRA (stage_worker.lora) the plan runs its LoRALinears' base products, and adds the adapters' products
(kernels/csrc/lora_ops.h) in a step short enough for that kernel (kernels.dispatch cpu_lora); a longer step
with adapter tokens runs the Python layer, whose torch products suit it better.
A plan is rebuilt when a parameter, buffer or submodule of any layer is replaced, when the model moves (.to()),
or when a forward hook is registered (stage_worker.layers.changes).
"""
from __future__ import annotations

from typing import TypeVar

import torch
from torch.nn.modules import module as _torch_module

from kernels import cpu_ops, dispatch
from kernels.kv_quant import is_fp8
from kernels.reference import step_memo
from stage_worker import layers
from stage_worker.lora import LoRALinear
from stage_worker.quant_weight import QuantizedWeight


_enabled = True
# the attention classes whose forward the plan's C++ repeats call for call (stage_worker.model.Attention registers
# itself): a subclass (a family's own attention) or another kind (MLA) runs its own Python
_covered_attention: set[type] = set()
_Class = TypeVar("_Class", bound=type)


def enable(on: bool) -> None:
    """Plans on (the default) or off in this process, for benchmarks that compare the two in one run."""
    global _enabled
    _enabled = on


def covers(attention: _Class) -> _Class:
    """Class decorator: the plan may run a layer whose attention is exactly this class."""
    _covered_attention.add(attention)
    return attention


class LayerPlan:
    def __init__(self, epoch: int, cpp=None, dtype: torch.dtype | None = None, head_dim: int = 0, hooked=(),
                 lora=None, attn=None):
        self.epoch, self.cpp, self.dtype, self.head_dim = epoch, cpp, dtype, head_dim
        self.attn = attn  # the layer's Attention: its fp8 cache's scales are read at each call (they may be set late)
        self.hooked = hooked  # the submodules whose hooks ruled the plan out (removing a hook is no change)
        # the stage's stage_worker.lora.LoRAMapping when the layer's linears take adapters: the plan adds their
        # products to a step short enough for the C++ LoRA kernel (the Python layer runs a longer one)
        self.lora = lora

    def stale(self) -> bool:
        return self.epoch != layers.changes() or (
            bool(self.hooked) and not any(m._forward_hooks or m._forward_pre_hooks for m in self.hooked))

    def runs(self, x: torch.Tensor, kv_cache) -> bool:
        return (self.cpp is not None and _enabled and x.dtype == self.dtype and x.is_cpu
                and (self.lora is None or not self.lora.groups or dispatch.cpu_lora(x, self.lora.num_tokens))
                and (kv_cache[0].dtype == self.dtype or is_fp8(kv_cache[0].dtype))
                and not self.attn.kv_scale.calibrating  # (the Python layer calibrates --calculate-kv-scales)
                and not (_torch_module._global_forward_hooks or _torch_module._global_forward_pre_hooks)
                and cpu_ops.covers(cpu_ops.current_attention_family(), self.head_dim))

    def __call__(self, x, residual, meta, kv_cache, cos_sin):
        seqs, visible = step_memo("query rows", (meta.context_lens, meta.query_start_loc),
                                  lambda: cpu_ops.query_rows(meta.context_lens, meta.query_start_loc))
        lora = self.lora.token_slots if self.lora is not None and self.lora.groups else None
        s = self.attn.kv_scale
        out, residual = self.cpp.forward(x, residual, meta.positions, cos_sin, kv_cache[0], kv_cache[1],
                                         meta.slot_mapping, meta.block_tables, seqs, visible,
                                         cpu_ops.current_attention_family(), cpu_ops.current_quant_family(), lora,
                                         s.k, s.v)
        return out, residual


def build(layer) -> LayerPlan:
    """The layer's plan, or a plan that never runs (cpp None) where the layer is not one it covers."""
    epoch = layers.changes()
    module = cpu_ops.load()
    attn, mlp = layer.self_attn, layer.mlp
    hooked = [m for m in layer.modules() if m is not layer and (m._forward_hooks or m._forward_pre_hooks)]
    if hooked:
        return LayerPlan(epoch, hooked=hooked)
    if (module is None or dispatch.forced() == "triton" or layer.sparse or not layer.cpu_plan
            or type(attn) not in _covered_attention
            or type(mlp) is not layers.MLP or attn.q_norm is not None):
        return LayerPlan(epoch)
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    dtype = norms[0].weight.dtype
    if dtype not in (torch.float32, torch.bfloat16) or any(
            type(n) is not layers.RMSNorm or n.weight.dtype != dtype or not n.weight.is_cpu for n in norms):
        return LayerPlan(epoch)
    linears = [_linear(module, m) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
    if None in linears:
        return LayerPlan(epoch)
    cpp = module.DecoderLayerPlan(norms[0].weight, norms[0].eps, norms[1].weight, norms[1].eps, *linears,
                                  attn.num_heads, attn.num_kv_heads, attn.scale)
    mappings = {id(m.mapping): m.mapping for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
                if isinstance(m, LoRALinear)}
    return LayerPlan(epoch, cpp, dtype, attn.head_dim, lora=next(iter(mappings.values()), None), attn=attn)


def _linear(module, linear):
    """The C++ form of a Linear whose product is a C++ call here (stage_worker.layers._matmul), else None."""
    if type(linear) not in (layers.Linear, LoRALinear) or (linear.reduce is not None and linear.reduce.size > 1):
        return None
    lora = (linear.lora_a, linear.lora_bt) if isinstance(linear, LoRALinear) else (None, None)
    if lora[0] is not None and lora[1] is None:  # (its slots not on the CPU)
        return None
    w, bias = linear.weight, linear.bias
    if bias is not None and not bias.is_cpu:
        return None
    if isinstance(w, QuantizedWeight):
        if not w.qs.is_cpu or not dispatch.quant_built() or not w.plain:
            return None
        return module.LayerLinear("quant", w.qs, w.scales, w.mins, bias, 0, w.int8_activations, *lora)
    if not w.is_cpu:
        return None
    out_features = getattr(w, "bf16_out_features", None)
    if out_features is not None:
        return module.LayerLinear("bf16", w, None, None, bias, out_features, False, *lora)
    return module.LayerLinear("mkldnn" if w.is_mkldnn else "dense", w, None, None, bias, 0, False, *lora)
