"""Multi-LoRA on a stage: adapters' weights in device slots, applied per token to a mixed batch.

With LoRA enabled, each targeted linear of the stage's layers (the merged q/k/v and gate/up, o, down) becomes a
LoRALinear: its base product, plus for every adapter in the step B(Ax) on that adapter's tokens. Each one
holds `max_loras` slots, A as [slots, parts x max rank, in] and B as [slots, out, parts x max rank] (a merged
linear's parts block-diagonal in B, PEFT's scaling folded into B), zero-padded to the maximum rank, so a
smaller rank costs nothing in correctness. Tensor parallelism follows the base layer: a column-parallel
linear takes its rows of B (A whole); a row-parallel one its columns of A (B whole), and its LoRA output joins
the base's partial sums before the one all-reduce.

LoRAManager keeps the slots: an adapter a step needs is put in a free slot, or the least recently used slot
that the step does not need (at most --max-loras adapters per step); adapters read from disk are kept in host
memory, the --max-cpu-loras most recently used. The product is kernels.add_lora: Triton's per-token kernel on
CUDA (kernels/triton_lora.py), the torch reference (a gather per adapter in the step) on CPU.
"""
from __future__ import annotations

import json
import logging
import re
from collections import OrderedDict
from dataclasses import dataclass

import torch
from safetensors import SafetensorError

import kernels
from safetensors.torch import load_file

from stagemesh.core.lora import (WEIGHTS_FILE, AdapterConfig, LoRAError, LoRALimits, LoRAModule, allowed_path,
                                  lora_from_args, read_adapter_config)
from stagemesh.core.errors import StagemeshError
from stagemesh.core.model_config import ModelConfig
from stage_worker.layers import Linear, _matmul

log = logging.getLogger("stagemesh.stage")

_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
_BLOCK = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
          "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


class LoRAMapping:
    """Which adapter slot each of the step's tokens uses, shared by the stage's LoRA layers: (slot, token
    rows) per adapter in the step, rows None when every token uses it; and, made on first use in a step (the
    Triton kernel's form), each token's slot or -1."""

    def __init__(self, device=None) -> None:
        self.device = device
        self.groups: list[tuple[int, torch.Tensor | None]] = []
        self.num_tokens = 0
        self._token_slots: torch.Tensor | None = None

    def set(self, groups: list[tuple[int, torch.Tensor | None]], num_tokens: int) -> None:
        self.groups, self.num_tokens, self._token_slots = groups, num_tokens, None

    @property
    def token_slots(self) -> torch.Tensor:
        if self._token_slots is None:
            slots = torch.full((self.num_tokens,), -1, dtype=torch.int32, device=self.device)
            for slot, rows in self.groups:
                if rows is None:
                    slots.fill_(slot)
                else:
                    slots[rows] = slot
            self._token_slots = slots
        return self._token_slots


@dataclass(frozen=True)
class _Part:
    module: str  # q_proj, ...
    dim: int  # 0: this rank holds rows [start, start + length) of the base weight; 1: columns
    start: int
    length: int
    dest: int  # where its rows go in the merged output (dim 0)


class LoRALinear(Linear):
    lora_a: torch.Tensor  # (buffers, made in __init__)
    lora_b: torch.Tensor
    lora_bt: torch.Tensor | None

    def __init__(self, base: Linear, layer: int, parts: list[_Part], max_loras: int, max_rank: int, dtype, device,
                 mapping: LoRAMapping):
        super().__init__(base.weight, base.bias, base.reduce)
        self.layer, self.parts, self.mapping, self.max_rank = layer, parts, mapping, max_rank
        out_features, in_features = base.weight.shape  # this rank's, before any packing
        width = len(parts) * max_rank
        self.register_buffer("lora_a", torch.zeros(max_loras, width, in_features, dtype=dtype, device=device),
                             persistent=False)
        self.register_buffer("lora_b", torch.zeros(max_loras, out_features, width, dtype=dtype, device=device),
                             persistent=False)
        # on CPU, B transposed too ([slots, width, out]): the C++ kernel's expand runs along B's columns
        on_cpu = torch.device(device).type == "cpu"
        self.register_buffer("lora_bt", torch.zeros(max_loras, width, out_features, dtype=dtype, device=device)
                             if on_cpu else None, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _matmul(x, self.weight, self.bias)
        if self.mapping.groups:
            kernels.add_lora(y, x, self.lora_a, self.lora_b, self.mapping, self.lora_bt)
        return self.reduce.all_reduce(y) if self.reduce is not None else y

    def fill(self, slot: int, weights: dict[str, tuple[torch.Tensor, torch.Tensor]], scaling: float) -> None:
        """Slot `slot` holds one adapter's (A, B) of this layer's parts (a part it does not target: zeros)."""
        a, b, r = self.lora_a[slot], self.lora_b[slot], self.max_rank
        a.zero_()
        b.zero_()
        for i, part in enumerate(self.parts):
            if part.module not in weights:
                continue
            full_a, full_b = weights[part.module]
            rank = full_a.shape[0]
            if part.dim == 0:  # column-parallel: this rank's rows of B
                a[i * r:i * r + rank].copy_(full_a)
                b[part.dest:part.dest + part.length, i * r:i * r + rank].copy_(
                    full_b[part.start:part.start + part.length] * scaling)
            else:  # row-parallel: this rank's columns of A
                a[i * r:i * r + rank].copy_(full_a[:, part.start:part.start + part.length])
                b[:, i * r:i * r + rank].copy_(full_b * scaling)
        if self.lora_bt is not None:
            self.lora_bt[slot].copy_(b.T)


def _parts(linear: Linear) -> tuple[int, list[_Part]] | None:
    """(layer index, parts) of a linear an adapter may target, from its weight's checkpoint slices."""
    found = []
    for shard in getattr(linear.weight, "shards", ()):
        m = re.match(r"^model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.weight$", shard.name)
        if m is None or m.group(3) not in _BLOCK or shard.stack is not None:
            return None
        found.append((int(m.group(1)), _Part(m.group(3), shard.dim, shard.start, shard.length, shard.dest)))
    if not found:
        return None
    return found[0][0], [p for _, p in found]


def shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(out, in) of each target module's whole base weight."""
    d, h, inter = cfg.head_dim, cfg.hidden_size, cfg.intermediate_size
    return {"q_proj": (cfg.num_attention_heads * d, h), "k_proj": (cfg.num_key_value_heads * d, h),
            "v_proj": (cfg.num_key_value_heads * d, h), "o_proj": (h, cfg.num_attention_heads * d),
            "gate_proj": (inter, h), "up_proj": (inter, h), "down_proj": (h, inter)}


@dataclass
class _Adapter:
    config: AdapterConfig
    weights: dict[int, dict[str, tuple[torch.Tensor, torch.Tensor]]]  # layer -> module -> (A, B), this stage's


def load_adapter(module: LoRAModule, cfg: ModelConfig, layers: range, max_rank: int, dense_layers: set[int],
                 dtype: torch.dtype) -> _Adapter:
    """The adapter's weights of `layers`, checked against the base model: every tensor a lora_A/lora_B of a
    targeted module of a layer the model has, in the base weight's shape with the config's rank; a module
    targeted in a layer without it (an MoE layer's MLP) is refused."""
    config = read_adapter_config(module.name, module.path, max_rank)
    where = f"LoRA adapter {module.name!r} ({module.path})"
    try:
        tensors = load_file(str(config.path / WEIGHTS_FILE))
    except (SafetensorError, OSError, ValueError, RuntimeError) as err:
        raise LoRAError(f"{where}: {WEIGHTS_FILE} cannot be read: {err}") from None
    want = shapes(cfg)
    found: dict[int, dict[str, dict[str, torch.Tensor]]] = {}
    for key, tensor in tensors.items():
        m = _KEY.match(key)
        if m is None:
            raise LoRAError(f"{where}: {key} is not a LoRA weight of a decoder layer's linear (only "
                            f"lora_A/lora_B of {', '.join(want)} are served)")
        layer, block, name, ab = int(m.group(1)), m.group(2), m.group(3), m.group(4)
        if name not in config.target_modules or _BLOCK.get(name) != block:
            raise LoRAError(f"{where}: {key} is for a module its target_modules do not list")
        if layer >= cfg.num_hidden_layers:
            raise LoRAError(f"{where}: {key} is for layer {layer}; the base model has {cfg.num_hidden_layers} "
                            f"(an adapter for another base model?)")
        if block == "mlp" and layer not in dense_layers:
            raise LoRAError(f"{where}: {key}: layer {layer}'s MLP is a mixture of experts, which LoRA does not "
                            f"cover here")
        out_f, in_f = want[name]
        shape = (config.rank, in_f) if ab == "A" else (out_f, config.rank)
        if tuple(tensor.shape) != shape:
            raise LoRAError(f"{where}: {key} has shape {list(tensor.shape)}; the base model and r={config.rank} "
                            f"want {list(shape)} (an adapter for another base model?)")
        if not tensor.is_floating_point() or not torch.isfinite(tensor).all():
            raise LoRAError(f"{where}: {key} is not finite floating point")
        found.setdefault(layer, {}).setdefault(name, {})[ab] = tensor
    weights: dict[int, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
    for layer, modules in found.items():
        for name, ab in modules.items():
            if set(ab) != {"A", "B"}:
                raise LoRAError(f"{where}: layer {layer} {name} has lora_{''.join(ab)} without its pair")
            if layer in layers:
                weights.setdefault(layer, {})[name] = (ab["A"].to(dtype), ab["B"].to(dtype))
    if not found:
        raise LoRAError(f"{where}: {WEIGHTS_FILE} holds no LoRA weights")
    return _Adapter(config, weights)


@dataclass(frozen=True)
class LoRASettings:
    """--enable-lora on a stage: the limits and the adapters it may serve."""
    limits: LoRALimits
    modules: tuple[LoRAModule, ...]
    allowed_paths: tuple[str, ...] = ()  # --allowed-local-lora-path: where adapters loaded at run time may lie

    @classmethod
    def from_args(cls, args) -> LoRASettings | None:
        found = lora_from_args(args)
        return None if found is None else cls(*found, tuple(args.allowed_local_lora_path))

    def runtime_path(self, name: str, path: str) -> str:
        """The directory an adapter loaded at run time is read from: one of the stage's own --lora-modules, or
        under --allowed-local-lora-path (a path from a caller is a hostile input); LoRAError otherwise."""
        if any(m.name == name and m.path == path for m in self.modules):
            return path
        return allowed_path(path, self.allowed_paths, name)

    def argv(self) -> list[str]:
        """The flags that give these settings (a TP follower's command line)."""
        lim = self.limits
        argv = ["--enable-lora", "--max-loras", str(lim.max_loras), "--max-lora-rank", str(lim.max_lora_rank)]
        if lim.max_cpu_loras is not None:
            argv += ["--max-cpu-loras", str(lim.max_cpu_loras)]
        if self.modules:
            argv += ["--lora-modules", *(json.dumps({"name": m.name, "path": m.path,
                                                     "base_model_name": m.base_model_name}) for m in self.modules)]
        return argv


class LoRAManager:
    """The stage's adapters: which are known (--lora-modules), which are in host memory, which in slots. Made
    before the weights load: it puts LoRALinear in the place of each linear an adapter may target."""

    def __init__(self, model, cfg: ModelConfig, settings: LoRASettings, dtype, device):
        if cfg.family.attention != "mha":
            raise StagemeshError(f"--enable-lora with multi-head latent attention ({cfg.model_type}) is not built yet")
        limits = settings.limits
        self.settings, self.cfg, self.limits, self.dtype = settings, cfg, limits, dtype
        self.modules = {m.name: m for m in settings.modules}
        self.mapping = LoRAMapping(device)
        self.layers: list[LoRALinear] = []
        for parent in list(model.modules()):
            for child_name, child in list(parent.named_children()):
                if type(child) is Linear and (found := _parts(child)) is not None:
                    lora = LoRALinear(child, found[0], found[1], limits.max_loras, limits.max_lora_rank, dtype,
                                      device, self.mapping)
                    setattr(parent, child_name, lora)
                    self.layers.append(lora)
        self.layer_range = range(model.layer_start, model.layer_end)
        self.dense_layers = {i for i in range(cfg.num_hidden_layers) if not cfg.is_sparse_layer(i)}
        self.device = device
        self.host: OrderedDict[str, _Adapter] = OrderedDict()  # LRU, up to --max-cpu-loras
        self.slots: OrderedDict[str, int] = OrderedDict()  # LRU: adapter -> slot

    def check_adapters(self) -> None:
        """Read every adapter once (the stage's start): a bad one stops the stage with its name and reason,
        rather than failing a step later. The --max-cpu-loras read last stay in host memory."""
        for name in self.modules:
            self._host(name)

    def add(self, name: str, path: str) -> bool:
        """Serve another adapter (loaded at run time): read and checked now, kept in host memory. False when it is
        served from this path already; another adapter of the name is replaced (the scheduler makes sure no
        request uses it)."""
        known = self.modules.get(name)
        if known is not None and known.path == path:
            return False
        module = LoRAModule(name, path)
        adapter = load_adapter(module, self.cfg, self.layer_range, self.limits.max_lora_rank, self.dense_layers,
                               self.dtype)
        self.remove(name)
        self.modules[name] = module
        self._keep(name, adapter)
        return True

    def remove(self, name: str) -> bool:
        """Serve the adapter no more (its slot is free again); False when it was not served."""
        if self.modules.pop(name, None) is None:
            return False
        self.host.pop(name, None)
        self.slots.pop(name, None)
        return True

    def check(self, names: set[str]) -> None:
        """A step may use these adapters: each is known, and they fit the slots at once."""
        unknown = sorted(n for n in names if n not in self.modules)
        if unknown:
            raise LoRAError(f"LoRA adapter {unknown[0]!r} is not loaded on this stage")
        if len(names) > self.limits.max_loras:
            raise LoRAError(f"a step uses {len(names)} LoRA adapters; --max-loras is {self.limits.max_loras}")

    def prepare(self, chunk_adapters: list[str], chunk_tokens: list[int]) -> None:
        """Set the mapping for a step whose chunks use these adapters ("" for the base model) and have these
        token counts; the adapters it needs are put in slots first."""
        needed = {n for n in chunk_adapters if n}
        self.check(needed)
        slots = {name: self._slot(name, needed) for name in needed}
        num_tokens = sum(chunk_tokens)
        if not needed:
            self.mapping.set([], num_tokens)
            return
        if len(needed) == 1 and all(chunk_adapters):
            self.mapping.set([(slots[chunk_adapters[0]], None)], num_tokens)
            return
        rows: dict[str, list[int]] = {}
        at = 0
        for name, n in zip(chunk_adapters, chunk_tokens):
            if name:
                rows.setdefault(name, []).extend(range(at, at + n))
            at += n
        self.mapping.set([(slots[name], torch.tensor(r, dtype=torch.int64, device=self.device))
                          for name, r in rows.items()], num_tokens)

    def _slot(self, name: str, needed: set[str]) -> int:
        if name in self.slots:
            self.slots.move_to_end(name)
            return self.slots[name]
        if len(self.slots) < self.limits.max_loras:
            slot = min(set(range(self.limits.max_loras)) - set(self.slots.values()))
        else:
            victim = next(n for n in self.slots if n not in needed)  # check(): the step's adapters fit
            slot = self.slots.pop(victim)
        adapter = self._host(name)
        for layer in self.layers:
            layer.fill(slot, adapter.weights.get(layer.layer, {}), adapter.config.scaling)
        self.slots[name] = slot
        return slot

    def _host(self, name: str) -> _Adapter:
        if name in self.host:
            self.host.move_to_end(name)
            return self.host[name]
        adapter = load_adapter(self.modules[name], self.cfg, self.layer_range, self.limits.max_lora_rank,
                               self.dense_layers, self.dtype)
        self._keep(name, adapter)
        return adapter

    def _keep(self, name: str, adapter: _Adapter) -> None:
        log.info("LoRA adapter %r loaded (rank %d, %s)", name, adapter.config.rank,
                 ", ".join(adapter.config.target_modules))
        self.host[name] = adapter
        while len(self.host) > self.limits.cpu_loras:
            self.host.popitem(last=False)
