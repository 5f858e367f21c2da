"""Plain layers whose parameters know which checkpoint slices fill them.

Tensor parallelism lives here, not in the model's forward: each parameter
carries `shards`, a list of (checkpoint name, dim, start, length, dest offset)
that the weight loader reads with safetensors slices. A column-parallel layer
takes rows, a row-parallel layer takes columns and all-reduces its output.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as _torch_module

import kernels
from kernels import cpu_ops
from stagemesh.core.families import WeightNames
from stage_worker.parallel import TPGroup, shard_range, vocab_range
from stage_worker.quant_weight import QuantizedWeight


class Module(nn.Module):
    """An nn.Module made for a decode step's Python: a step of the default model at batch 1 calls the layers
    ~150 times and reads their parameters and submodules ~500 times, which plain nn.Module makes 1-2 us a
    call (its hook machinery) and ~0.5 us a read (found by __getattr__ after the normal lookup fails): a
    tenth of the step on CPU (benchmarks/RESULTS.md, 2026-11-26). So:
    - a call goes straight to forward unless a forward hook is registered (then nn.Module's own call runs);
    - a parameter or submodule set as an attribute is kept in the instance dict too, where the normal
      lookup finds it; nn.Module's setattr and delattr drop it first and _apply (.to(), ...) refreshes it, so
      the dict never holds a stale one.
    Replacing a parameter, buffer or submodule, moving the module (_apply) and registering a forward hook
    count as changes (`changes()`): what caches a layer's structure (stage_worker.layer_plan) rebuilds then."""

    def __call__(self, *args, **kwargs):
        if self._forward_hooks or self._forward_pre_hooks or _torch_module._global_forward_hooks \
                or _torch_module._global_forward_pre_hooks:
            return super().__call__(*args, **kwargs)
        return self.forward(*args, **kwargs)

    def __setattr__(self, name: str, value) -> None:
        super().__setattr__(name, value)
        self._keep(name)

    def __delattr__(self, name: str) -> None:
        self.__dict__.pop(name, None)
        _changed()
        super().__delattr__(name)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        for name in (*self._parameters, *self._modules):
            self._keep(name)
        _changed()
        return self

    def register_forward_hook(self, *args, **kwargs):
        _changed()
        return super().register_forward_hook(*args, **kwargs)

    def register_forward_pre_hook(self, *args, **kwargs):
        _changed()
        return super().register_forward_pre_hook(*args, **kwargs)

    def _keep(self, name: str) -> None:
        if name in self.__dict__.get("_buffers", {}):
            _changed()
        for registry in (self.__dict__.get("_parameters", {}), self.__dict__.get("_modules", {})):
            if name in registry:
                _changed()
                if registry[name] is None:  # a registered name set to None: nn.Module's setattr left the dict
                    self.__dict__.pop(name, None)
                else:
                    self.__dict__[name] = registry[name]
                return


_changes = 0


def _changed() -> None:
    global _changes
    _changes += 1


def changes() -> int:
    """How many times a Module's parameters, buffers, submodules or forward hooks have changed."""
    return _changes


class Shard(NamedTuple):
    name: str  # tensor name in the checkpoint
    dim: int  # dimension sliced in the checkpoint tensor (and the parameter)
    start: int  # first index taken from the checkpoint tensor
    length: int  # how many indices
    dest: int  # where they go in the parameter along dim
    stack: int | None = None  # a stacked parameter (one slice per expert): which slice; None: the parameter


# Attributes of ours kept on torch Parameters; torch's Parameter type declares neither, so they are set and read by
# name (setattr / getattr)
_SHARDS, _BF16_OUT_FEATURES, _DEQUANTISED = "shards", "bf16_out_features", "dequantised_at_load"


def new_param(shape: tuple[int, ...], dtype: torch.dtype, device, shards: list[Shard]) -> nn.Parameter:
    param = nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)
    setattr(param, _SHARDS, shards)
    return param


def shards_of(param: torch.Tensor) -> list[Shard]:
    """The checkpoint slices new_param attached to `param`: what the loaders read into it."""
    return getattr(param, _SHARDS)


def dequantised_at_load(param: nn.Parameter) -> nn.Parameter:
    """Mark a linear's weight that its layer reads as a dense tensor (not through a product): a quantised
    checkpoint's is dequantised into it once at load (stage_worker.quant_methods.loader), in the stage's dtype."""
    setattr(param, _DEQUANTISED, True)
    return param


def is_dequantised_at_load(param: torch.Tensor) -> bool:
    return bool(getattr(param, _DEQUANTISED, False))


def full(name: str, rows: int) -> list[Shard]:
    """A replicated tensor: the whole of it, sliced along dim 0 from 0."""
    return [Shard(name, 0, 0, rows, 0)]


# Rows the packed layout is tuned for: decode batches of a few to a few dozen rows are where CPU
# serving spends its time; measured on AVX2 the packing serves 1 to 2048 rows at least as well as MKL.
_PACK_ROWS_HINT = 32


def pack_weights_for_cpu(model: nn.Module, warm: bool = True) -> None:
    """Re-lay linear weights, once after loading, for the CPU's fast products (CPU only).

    fp32: oneDNN's blocked format. torch's dense fp32 matmul goes to MKL, whose small-batch kernels
    are slow on non-Intel CPUs (a 4-row product takes 3x a 1-row one on AMD EPYC); oneDNN's JIT
    kernels on a pre-packed weight keep small batches near the memory bound on any x86 CPU.
    bf16: blocks for kernels/csrc/bf16_linear.cpp (bf16 weights, fp32 sums), which reads half the
    bytes of the fp32 path and needs no bf16 instructions; torch's own bf16 linear is slower than
    fp32 on a CPU without them. Without the built kernels bf16 stays on torch's.
    Benchmarks: benchmarks/bench_decode_inprocess.py, benchmarks/bench_serving.py, benchmarks/bench_bf16_cpu.py.
    `warm`: build oneDNN's products of every row count now (warm_onednn), not as steps first meet them
    (--skip-server-warmup).
    """
    linears = [m for m in model.modules() if isinstance(m, (Linear, ParallelLMHead))
               and not isinstance(m.weight, QuantizedWeight)]  # those run on kernels/csrc/quant_linear.cpp
    for module in linears:
        if module.weight.dtype == torch.bfloat16 and not hasattr(module.weight, _BF16_OUT_FEATURES) \
                and cpu_ops.load() is not None:
            packed = nn.Parameter(cpu_ops.pack_bf16_weight(module.weight.data), requires_grad=False)
            setattr(packed, _BF16_OUT_FEATURES, module.weight.shape[0])
            module.weight = packed
    if not torch.backends.mkldnn.is_available():
        return
    for module in linears:
        if module.weight.dtype == torch.float32 and not module.weight.is_mkldnn:
            module.weight = nn.Parameter(repack_onednn(module.weight.data), requires_grad=False)
    if warm:
        warm_onednn(linears)


def repack_onednn(weight: torch.Tensor) -> torch.Tensor:
    """A dense fp32 weight [out, in] in oneDNN's blocked format, as pack_weights_for_cpu lays it."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_ROWS_HINT)


def warm_onednn(linears) -> None:
    """Build oneDNN's product of each packed weight shape at each row count it runs at (onednn_rows), once
    as the weights are packed, as vLLM warms its model up before serving: what oneDNN keeps for them (~0.5 MiB
    each, 48 per weight shape) is then in the stage's memory from the start, rather than added by the first step
    of each row count, some of them an hour in; and no step waits for a kernel to be built."""
    sizes = sorted({onednn_rows(n) for n in range(1, ONEDNN_PIECE_ROWS + 1)})
    done = set()
    with torch.inference_mode():
        for module in linears:
            w, bias = module.weight, getattr(module, "bias", None)
            if not (w.is_mkldnn and w.dtype == torch.float32):
                continue
            key = (tuple(w.shape), None if bias is None else (bias.dtype, tuple(bias.shape)))
            if key in done:
                continue
            done.add(key)
            x = torch.zeros(ONEDNN_PIECE_ROWS, w.shape[1], dtype=w.dtype)
            for rows in sizes:
                torch.ops.mkldnn._linear_pointwise(x[:rows], w, bias, "none", [], "")


def _matmul(x: torch.Tensor, weight: torch.Tensor, bias=None) -> torch.Tensor:
    if isinstance(weight, QuantizedWeight):
        return weight.linear(x, bias)
    out_features = getattr(weight, _BF16_OUT_FEATURES, None)
    if out_features is not None:
        return cpu_ops.linear_bf16(x, weight, out_features, bias)
    if weight.is_mkldnn:
        return onednn_linear(x, weight, bias)
    return F.linear(x, weight, bias)


# oneDNN keeps what it builds for a product (its JIT kernels and descriptors, ~0.4-1 MiB) for each row count it
# meets, in two caches of 1,024 entries (ideep's and oneDNN's primitive cache), freed only when those fill. A
# serving stage meets a new row count in most steps (the tokens of a step's chunks), so its RSS rose ~8 MiB/min
# for an hour, up to ~1.5 GB (issue 43's soak, benchmarks/bench_soak.py). Packed products therefore run on a
# bounded set of row counts, as vLLM's CPU backend bounds its oneDNN matmul cache: up to 16 rows as they are
# (decode), then in pieces of at most 256 rows, a piece padded to one of 8 sizes per octave (under 12.5% more
# rows): 48 sizes per weight shape. kernels/csrc/decoder_layer.cpp does the same (the same bits as this layer).
ONEDNN_EXACT_ROWS = 16
ONEDNN_PIECE_ROWS = 256


def onednn_rows(rows: int) -> int:
    """The row count a piece of `rows` rows (1 to ONEDNN_PIECE_ROWS) runs at: itself up to 16, else rounded
    up to a multiple of an eighth of its octave."""
    if rows <= ONEDNN_EXACT_ROWS:
        return rows
    step = 1 << (rows.bit_length() - 4)
    return -(-rows // step) * step


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias=None) -> torch.Tensor:
    """x W^T (+ b) with oneDNN's packed weight, on the bounded row counts above."""
    rows = x.shape[0] if x.dim() == 2 else x.numel() // x.shape[-1]
    if rows <= ONEDNN_PIECE_ROWS and rows == onednn_rows(rows):
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    if x.dim() != 2:
        return onednn_linear(x.reshape(rows, x.shape[-1]), weight, bias).reshape(*x.shape[:-1], -1)
    outs = []
    for start in range(0, rows, ONEDNN_PIECE_ROWS):
        piece = x[start:start + ONEDNN_PIECE_ROWS]
        n = piece.shape[0]
        padded = onednn_rows(n)
        if padded != n:
            piece = F.pad(piece, (0, 0, 0, padded - n))
        out = torch.ops.mkldnn._linear_pointwise(piece, weight, bias, "none", [], "")
        outs.append(out[:n] if padded != n else out)
    return outs[0] if len(outs) == 1 else torch.cat(outs)


class Linear(Module):
    """y = x W^T (+ b); W is already this rank's shard. Row-parallel ones all-reduce."""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None = None, reduce: TPGroup | None = None):
        super().__init__()
        self.weight = weight
        self.bias = bias
        self.reduce = reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _matmul(x, self.weight, self.bias)
        return self.reduce.all_reduce(y) if self.reduce is not None else y


def column_parallel(parts: list[tuple[str, int, int]], in_features: int, dtype, device,
                    bias: bool = False) -> Linear:
    """Merged column-parallel linear: parts are (checkpoint prefix, row start, rows) stacked in order."""
    rows = sum(n for _, _, n in parts)
    offsets = [sum(n for _, _, n in parts[:i]) for i in range(len(parts))]
    weight = new_param((rows, in_features), dtype, device,
                       [Shard(f"{p}.weight", 0, s, n, o) for (p, s, n), o in zip(parts, offsets)])
    b = None
    if bias:
        b = new_param((rows,), dtype, device, [Shard(f"{p}.bias", 0, s, n, o) for (p, s, n), o in zip(parts, offsets)])
    return Linear(weight, b)


def row_parallel(prefix: str, out_features: int, start: int, cols: int, tp: TPGroup, dtype, device,
                 reduce: bool = True) -> Linear:
    """reduce=False leaves the partial sums to a caller that adds more before one all-reduce."""
    weight = new_param((out_features, cols), dtype, device, [Shard(f"{prefix}.weight", 1, start, cols, 0)])
    return Linear(weight, reduce=tp if reduce else None)


SEPARATE_NAMES = WeightNames()  # gate_proj and up_proj, each its own tensor


class MLP(Module):
    """SwiGLU MLP: column-parallel gate/up, row-parallel down (all-reduced unless reduce=False)."""

    def __init__(self, prefix: str, hidden_size: int, intermediate_size: int, tp: TPGroup, dtype, device,
                 reduce: bool = True, names: WeightNames = SEPARATE_NAMES):
        """names: how the family's checkpoint spells gate and up (separate tensors, or one fused)."""
        super().__init__()
        start, per = shard_range(intermediate_size, tp, f"the intermediate size of {prefix}")
        self.gate_up_proj = column_parallel(names.gate_up(prefix, intermediate_size, start, per),
                                            hidden_size, dtype, device)
        self.down_proj = row_parallel(f"{prefix}.down_proj", hidden_size, start, per, tp, dtype, device, reduce)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(kernels.silu_and_mul(self.gate_up_proj(x)))


class VocabParallelEmbedding(Module):
    """Each rank holds a slice of the vocabulary; lookups outside it give zeros, summed over ranks."""

    def __init__(self, name: str, vocab_size: int, hidden: int, tp: TPGroup, dtype, device):
        super().__init__()
        self.tp = tp
        self.dtype = dtype
        self.start, self.stop, per = vocab_range(vocab_size, tp)
        self.weight = new_param((per, hidden), dtype, device, [Shard(name, 0, self.start, self.stop - self.start, 0)])
        if self.stop - self.start < per:
            self.weight.data[self.stop - self.start:].zero_()

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if isinstance(self.weight, QuantizedWeight):  # a GGUF's quantised table: only the rows looked up
            return self.weight.rows(ids, self.dtype)
        return F.embedding(ids, self.weight)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self._lookup(ids)
        local = ids - self.start
        outside = (ids < self.start) | (ids >= self.stop)
        out = self._lookup(local.masked_fill(outside, 0))
        out.masked_fill_(outside[:, None], 0)
        return self.tp.all_reduce(out)


class ParallelLMHead(Module):
    """Vocab-parallel LM head: local logits, all-gathered into the full vocabulary."""

    def __init__(self, name: str, vocab_size: int, hidden: int, tp: TPGroup, dtype, device):
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        start, stop, per = vocab_range(vocab_size, tp)
        self.weight = new_param((per, hidden), dtype, device, [Shard(name, 0, start, stop - start, 0)])
        if stop - start < per:
            self.weight.data[stop - start:].zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = _matmul(x, self.weight)
        return self.tp.all_gather_last_dim(logits)[:, : self.vocab_size]


class RMSNorm(Module):
    def __init__(self, name: str, size: int, eps: float, dtype, device):
        super().__init__()
        self.eps = eps
        self.weight = new_param((size,), dtype, device, full(name, size))
