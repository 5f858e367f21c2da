"""Quantized checkpoints as their quantizers write them, one module each in this package, keyed by
config.json's quantization_config.quant_method (stage_worker.quant_methods.method says what a module
declares). A module is found by being here: adding a method is adding its module and its parity test.

A checkpoint whose method, or any field of its config, is not honoured is refused at start-up by name;
`--quantization` names the method (vLLM's names) or is refused when it disagrees with the checkpoint.
"""
from __future__ import annotations

import importlib
import pkgutil

from stagemesh.core.errors import StagemeshError
from stagemesh.core.families import FAMILIES
from stagemesh.core.model_config import ModelConfig
from stage_worker.quant_methods.method import QuantMethod

_SKIP = {"method", "layout", "assemble", "loader", "packing", "experts"}  # the package's own modules, not methods


def _discover() -> dict[str, type[QuantMethod]]:
    found: dict[str, type[QuantMethod]] = {}
    for info in pkgutil.iter_modules(__path__):
        if info.name in _SKIP:
            continue
        method = importlib.import_module(f"{__name__}.{info.name}").METHOD
        if not issubclass(method, QuantMethod) or method.name in found:
            raise RuntimeError(f"{__name__}.{info.name}: METHOD must be one new QuantMethod")
        found[method.name] = method
    return found


METHODS = _discover()
# vLLM's --quantization names that mean a method here with another kernel (Marlin): the same checkpoint
ALIASES = {"gptq_marlin": "gptq", "awq_marlin": "awq"}
# vLLM's names that also quantise an unquantised checkpoint at load (stage_worker.quantization)
AT_LOAD = {"fp8"}
# formats people publish that are not built yet: refused with what they are
NOT_BUILT = {
    "bitsandbytes": "bitsandbytes' 4-bit / 8-bit weights: not built",
    "hqq": "HQQ: not built", "eetq": "EETQ: not built", "quark": "AMD Quark: not built",
    "torchao": "torchao's tensor subclasses: not built",
}


def checkpoint_method(cfg: ModelConfig, flag: str | None) -> QuantMethod | None:
    """The method of the model's quantization_config (None: the checkpoint is not quantised), refusing by name
    what is not built and a --quantization that disagrees with it."""
    qc = cfg.raw.get("quantization_config")
    if qc is None:
        if (flag in METHODS or flag in ALIASES) and flag not in AT_LOAD:
            raise StagemeshError(f"--quantization {flag} reads a checkpoint quantised in that format; this model's "
                                 "config.json has no quantization_config")
        return None
    if not isinstance(qc, dict) or not isinstance(qc.get("quant_method"), str):
        raise StagemeshError("config.json's quantization_config has no quant_method: stagemesh cannot tell how "
                             "its weights are stored")
    name = qc["quant_method"]
    if name in NOT_BUILT:
        raise StagemeshError(f"quantization_config.quant_method {name!r}: {NOT_BUILT[name]}")
    if name not in METHODS:
        raise StagemeshError(f"quantization_config.quant_method {name!r} is not built; stagemesh loads "
                             f"{', '.join(sorted(METHODS))}")
    if name == "compressed-tensors" and qc.get("kv_cache_scheme") and not qc.get("config_groups") and flag is None:
        return None  # only the KV cache is quantised (its scales: stage_worker.kv_scales); the weights are dense
    if flag is not None and ALIASES.get(flag, flag) != name:
        raise StagemeshError(f"--quantization {flag} does not match the checkpoint's quantization_config.quant_method "
                             f"{name!r} (give --quantization {name}, or none)")
    method = METHODS[name]
    if method.family_only and name not in cfg.family.own_quant_methods:
        built = [t for t, f in FAMILIES.items() if name in f.own_quant_methods]
        raise StagemeshError(f"quantization_config.quant_method {name!r} is built for model_type "
                             f"{', '.join(built)}, not {cfg.model_type}")
    return method(qc)


def flag_names() -> tuple[str, ...]:
    """The --quantization values that name a checkpoint's method."""
    return tuple(sorted(METHODS)) + tuple(sorted(ALIASES))
