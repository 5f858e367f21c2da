"""The per-tensor scales of an fp8 KV cache, one k_scale and one v_scale per layer (kernels.kv_quant), from one
of three sources, as vLLM takes them:

- the checkpoint: `model.layers.N.self_attn.k_scale` / `.v_scale` (llm-compressor, AutoFP8), ModelOpt's
  `.self_attn.k_proj.k_scale` / `.self_attn.v_proj.v_scale`, compressed-tensors' `.self_attn.k_proj.output_scale`
  / `.v_proj.output_scale` under a kv_cache_scheme, the deprecated single `.self_attn.kv_scale` (k and v);
- none there: 1.0 (vLLM warns that accuracy may suffer; so does the stage's log);
- --calculate-kv-scales: from the first forward's keys and values, k_scale = max|K| / 200 and v_scale =
  max|V| / 100 (vLLM's K_SCALE_CONSTANT and V_SCALE_CONSTANT), the maxima taken over every rank of the stage so
  that the blocks its ranks export, offload or import share one scale per layer (vLLM's ranks each keep their
  own); until then a block brought in from elsewhere (KV transfer, the disk tier) gives them.

Every scale tensor a checkpoint has for the stage's layers is read and checked, whatever the cache's dtype: one
that cannot be honoured (per-head or per-channel, zero, negative, not finite, a v_scale without its k_scale) is
refused by name; with --kv-cache-dtype auto they are unused and the log says so. The queries' q_scale and the
attention's prob_scale are read and checked too: attention runs in the model's dtype here (as on vLLM's backends
without fp8 attention), so they have nothing to scale.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from stagemesh.core import kv_cache_dtype
from stagemesh.core.errors import StagemeshError
from stagemesh.core.model_config import ModelConfig

log = logging.getLogger("stagemesh.stage")

K_SCALE_CONSTANT, V_SCALE_CONSTANT = 200.0, 100.0  # vLLM's (envs.K_SCALE_CONSTANT, envs.V_SCALE_CONSTANT)


def as_f32(x: float) -> float:
    """x rounded to fp32: every kernel computes with the scale so, and a scale must read the same after it crossed
    the wire (protobuf float) or a disk file (fp32)."""
    return float(torch.tensor(x, dtype=torch.float32))


@dataclass
class KVScale:
    """One layer's scales (1.0 until something sets them). `calibrating`: the next forward sets them from its
    keys and values, the maxima agreed over `group` (the stage's ranks)."""
    k: float = 1.0
    v: float = 1.0
    calibrating: bool = False
    group: Any = field(default=None, repr=False)

    def calibrate(self, k: torch.Tensor, v: torch.Tensor) -> None:
        amax = torch.stack([x.abs().amax().float() if x.numel() else x.new_zeros((), dtype=torch.float32)
                            for x in (k, v)])
        if self.group is not None:
            self.group.all_reduce_max(amax)
        k_max, v_max = amax.tolist()
        self.k = as_f32(k_max / K_SCALE_CONSTANT) if k_max > 0 else 1.0  # (all zeros: any scale holds them)
        self.v = as_f32(v_max / V_SCALE_CONSTANT) if v_max > 0 else 1.0
        self.calibrating = False


class KVScales:
    """A stage's layers' scales and where they came from: "checkpoint", "default" (1.0), "calculated", "pending"
    (--calculate-kv-scales before the first forward) or "unused" (a cache of the model's dtype)."""

    def __init__(self, num_layers: int, source: str, group=None):
        self.layers = [KVScale(group=group) for _ in range(num_layers)]
        self.source = source

    @property
    def pending(self) -> bool:
        return self.source == "pending"

    def values(self) -> list[tuple[float, float]]:
        return [(s.k, s.v) for s in self.layers]

    def arm(self) -> None:
        """Before a forward of real tokens: the pending scales are calculated from it."""
        if self.pending:
            for s in self.layers:
                s.calibrating = True

    def settle(self) -> None:
        """After that forward: the scales it calculated stay."""
        if self.pending and not any(s.calibrating for s in self.layers):
            self.source = "calculated"
            log.info("KV cache scales calculated from the first forward (--calculate-kv-scales): %s", self.summary())

    def adopt(self, values: list[tuple[float, float]], where: str) -> None:
        """Pending scales taken from blocks brought in (they were calculated where the blocks were computed)."""
        if not self.pending:
            return
        for s, (k, v) in zip(self.layers, values, strict=True):
            s.k, s.v = as_f32(k), as_f32(v)
        self.source = "calculated"
        log.info("KV cache scales taken from %s (--calculate-kv-scales, before any forward here): %s", where,
                 self.summary())

    def summary(self) -> str:
        if not self.layers:
            return "no layers"
        ks, vs = [s.k for s in self.layers], [s.v for s in self.layers]
        return f"k_scale {min(ks):.4g}-{max(ks):.4g}, v_scale {min(vs):.4g}-{max(vs):.4g} over {len(ks)} layers"


@dataclass(frozen=True)
class CheckpointScales:
    """What a checkpoint holds for a stage's layers: each layer's (k, v) or None, and how many q / prob scales."""
    layers: list[tuple[float, float] | None]
    unused: int = 0  # q_scale and prob_scale tensors read (and checked), which attention in the model's dtype needs not

    @property
    def found(self) -> int:
        return sum(s is not None for s in self.layers)


def _names(prefix: str, compressed_tensors: bool) -> dict[str, list[str]]:
    k = [f"{prefix}.k_scale", f"{prefix}.k_proj.k_scale", f"{prefix}.attn.k_scale"]
    v = [f"{prefix}.v_scale", f"{prefix}.v_proj.v_scale", f"{prefix}.attn.v_scale"]
    if compressed_tensors:  # its KV scales are the k and v projections' output scales
        k.append(f"{prefix}.k_proj.output_scale")
        v.append(f"{prefix}.v_proj.output_scale")
    return {"k": k, "v": v, "kv": [f"{prefix}.kv_scale"],
            "unused": [f"{prefix}.q_scale", f"{prefix}.prob_scale", f"{prefix}.attn.q_scale",
                       f"{prefix}.attn.prob_scale"]}


def _scalar(reader, name: str) -> float:
    t = reader.read_whole(name)
    if t.numel() != 1:
        raise StagemeshError(f"{name}: a KV cache scale of shape {list(t.shape)}; only per-tensor scales (one value "
                             "per layer, as vLLM's fp8 KV cache) are built, not per-head or per-channel ones")
    value = as_f32(float(t.float().reshape(())))
    if not math.isfinite(value) or value <= 0:
        raise StagemeshError(f"{name}: a KV cache scale of {value}; a scale must be finite and positive")
    return value


def _one(reader, names: list[str], layer: int) -> float | None:
    present = [n for n in names if reader.has(n)]
    if len(present) > 1:
        raise StagemeshError(f"layer {layer} has two KV cache scales for one tensor ({present[0]}, {present[1]})")
    return _scalar(reader, present[0]) if present else None


def read_checkpoint_scales(reader, cfg: ModelConfig, layer_start: int, layer_end: int) -> CheckpointScales:
    """The KV cache scales `reader` (stage_worker.weights.CheckpointReader, or any reader with has and read_whole) holds
    for layers [layer_start, layer_end), every one read and checked."""
    compressed = check_kv_cache_scheme(cfg)
    layers: list[tuple[float, float] | None] = []
    unused = 0
    for i in range(layer_start, layer_end):
        names = _names(f"model.layers.{i}.self_attn", compressed)
        k, v, kv = (_one(reader, names[key], i) for key in ("k", "v", "kv"))
        if kv is not None and (k is not None or v is not None):
            raise StagemeshError(f"layer {i} has both the deprecated kv_scale and k_scale / v_scale")
        for name in names["unused"]:
            if reader.has(name):
                _scalar(reader, name)
                unused += 1
        if kv is not None:  # vLLM's remap of the deprecated single scale: k's and v's
            k = v = kv
        if v is not None and k is None:
            raise StagemeshError(f"layer {i} has a v_scale without its k_scale (model.layers.{i}.self_attn.k_scale)")
        layers.append(None if k is None else (k, k if v is None else v))  # (a k_scale alone serves both, as vLLM)
    return CheckpointScales(layers, unused)


KV_CACHE_SCHEME = {"type": "float", "num_bits": 8, "strategy": "tensor", "dynamic": False, "symmetric": True}
INFORMATIONAL = ("observer", "observer_kwargs")  # how the scales were calibrated


def check_kv_cache_scheme(cfg: ModelConfig) -> bool:
    """Whether the checkpoint says it holds KV scales (compressed-tensors' kv_cache_scheme); the fields vLLM takes
    are checked (an fp8, per-tensor, static, symmetric scheme), any other refused by name, as are ModelOpt's
    kv_cache_quant_algo other than FP8."""
    qc = cfg.raw.get("quantization_config") or {}
    algo = qc.get("kv_cache_quant_algo")
    if algo is not None and str(algo).upper() != "FP8":
        raise StagemeshError(f"quantization_config.kv_cache_quant_algo {algo!r} is not built (FP8 is)")
    scheme = qc.get("kv_cache_scheme")
    if scheme is None:
        return False
    if not isinstance(scheme, dict):
        raise StagemeshError(f"quantization_config.kv_cache_scheme must be an object, not {scheme!r}")
    for key, value in scheme.items():
        if key in KV_CACHE_SCHEME and value != KV_CACHE_SCHEME[key]:
            raise StagemeshError(f"quantization_config.kv_cache_scheme.{key} {value!r} is not built: the fp8 KV cache "
                                 f"takes {KV_CACHE_SCHEME[key]!r} ({_scheme_text()})")
        if key not in KV_CACHE_SCHEME and key not in INFORMATIONAL and value is not None:
            raise StagemeshError(f"quantization_config.kv_cache_scheme.{key} {value!r} is not built ({_scheme_text()})")
    missing = [key for key in ("type", "num_bits") if key not in scheme]
    if missing:
        raise StagemeshError(f"quantization_config.kv_cache_scheme has no {missing[0]} ({_scheme_text()})")
    return True


def _scheme_text() -> str:
    return ", ".join(f"{k} {v!r}" for k, v in KV_CACHE_SCHEME.items())


def stage_scales(num_layers: int, found: CheckpointScales | None, cache_dtype: str | None, calculate: bool,
                 first_layer: int, group=None) -> KVScales:
    """The scales of a stage's `num_layers` layers from what its checkpoint holds for them (None: a GGUF, which has
    no scale tensors), the cache's dtype name and --calculate-kv-scales; the choice is logged."""
    fp8 = kv_cache_dtype.is_fp8(cache_dtype)
    if calculate and not fp8:
        raise StagemeshError("--calculate-kv-scales sets an fp8 KV cache's scales: it needs --kv-cache-dtype fp8 "
                             "(or fp8_e4m3, fp8_e5m2)")
    found_count = found.found if found is not None else 0
    found_any = found_count > 0
    if found is not None and found.unused:
        log.info("the checkpoint's %d q_scale / prob_scale tensors are read and unused: attention runs in the "
                 "model's dtype (no fp8 queries)", found.unused)
    if not fp8:
        if found_any:
            log.info("the checkpoint's KV cache scales (%d layers) are read and unused: the KV cache is in the model's "
                     "dtype (--kv-cache-dtype auto); they apply to --kv-cache-dtype fp8", found_count)
        return KVScales(num_layers, "unused", group)
    if calculate:
        if found_any:
            log.info("--calculate-kv-scales: the first forward's scales replace the checkpoint's")
        return KVScales(num_layers, "pending", group)
    scales = KVScales(num_layers, "checkpoint" if found_any else "default", group)
    if found_any:
        assert found is not None
        missing = [first_layer + i for i, s in enumerate(found.layers) if s is None]
        for s, value in zip(scales.layers, found.layers):
            if value is not None:
                s.k, s.v = value
        if missing:
            log.warning("the checkpoint has no KV cache scales for layer(s) %s: 1.0 there (as vLLM)", missing)
    else:
        log.warning("--kv-cache-dtype %s with KV cache scales of 1.0: the checkpoint has none; accuracy may suffer "
                    "(vLLM warns alike). Calibrated scales (llm-compressor's kv_cache_scheme) or "
                    "--calculate-kv-scales set them", cache_dtype)
    return scales
