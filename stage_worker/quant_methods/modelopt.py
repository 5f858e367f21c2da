"""NVIDIA ModelOpt (TensorRT Model Optimizer) checkpoints: NVIDIA's published FP8 models (nvidia/*-FP8) are
stored so. Its config comes two ways, both read as vLLM reads them:
- config.json's quantization_config: `quant_method` "modelopt", `quant_algo`, `ignore`, `kv_cache_scheme`,
  and a `config_groups` that describes the same scheme again, compressed-tensors' way;
- the older hf_quant_config.json beside it: `{"producer": ..., "quantization": {"quant_algo",
  "kv_cache_quant_algo", "exclude_modules"}}` (stagemesh.core.model_config folds it into quantization_config
  when config.json has none).

Built, per quant_algo:
- FP8: float8_e4m3fn weights with one `weight_scale` a tensor and a static `input_scale` a tensor (x rounded
  to fp8 with it before the product, as the checkpoint's kernels do; a merged layer takes its parts' largest,
  vLLM's rule);
- FP8_PER_CHANNEL_PER_TOKEN: a `weight_scale` per output channel, activations dynamic per token (the products
  weight-only, exact).
The excluded modules (`ignore` / `exclude_modules`) are ModelOpt's wildcards (fnmatch), the name itself, or a
part of it (older ModelOpt's rule, which vLLM keeps). The KV cache's FP8 scales (`k_proj.k_scale`,
`v_proj.v_scale`) are stage_worker.kv_scales'. Every other quant_algo (NVFP4, MXFP8, FP8_PB_WO, the INT4 /
W4A8 AWQ forms, MIXED_PRECISION) is refused by name."""
from __future__ import annotations

from fnmatch import fnmatch

import torch

from stage_worker.quant_methods.method import Part, QuantMethod, channel_scales, read_fp8, refuse, rows_of, scalar

NAME = "modelopt"
BUILT = ("FP8", "FP8_PER_CHANNEL_PER_TOKEN")
# what the config_groups of an FP8 algo may say (ModelOpt writes the scheme again, compressed-tensors' way)
GROUP_KEYS = frozenset({"targets", "weights", "input_activations"})


def _fp8_args(algo: str, where: str, args) -> None:
    if args is None:
        return
    if not isinstance(args, dict) or args.get("type", "float") != "float" or args.get("num_bits", 8) != 8:
        raise refuse(NAME, f"{where} = {args!r} does not describe quant_algo {algo} (8-bit float)")


class ModelOpt(QuantMethod):
    name = NAME
    # producer: ModelOpt's name and version (informational); quantization: the hf_quant_config.json form
    fields = frozenset({"quant_algo", "ignore", "exclude_modules", "kv_cache_scheme", "kv_cache_quant_algo",
                        "config_groups", "producer", "group_size"})
    plan_dtype = "fp8"

    def __init__(self, qc):
        nested = qc.get("quantization")
        if nested is not None:  # {"quant_method": "modelopt", "quantization": {...}}: hf_quant_config.json's form
            if not isinstance(nested, dict):
                raise refuse(NAME, f"quantization = {nested!r} must be an object")
            qc = {**{k: v for k, v in qc.items() if k != "quantization"}, **nested}
        super().__init__(qc)
        algo = str(qc.get("quant_algo") or "").upper()
        if not algo:
            raise refuse(NAME, "quant_algo is missing: stagemesh cannot tell how the weights are stored")
        if algo not in BUILT:
            raise refuse(NAME, f"quant_algo {algo!r} is not built (stagemesh reads {', '.join(BUILT)})")
        if qc.get("group_size") is not None:
            raise refuse(NAME, f"group_size = {qc['group_size']!r} does not apply to quant_algo {algo}")
        self.algo = algo
        self.excluded = [*(qc.get("ignore") or []), *(qc.get("exclude_modules") or [])]
        if not all(isinstance(p, str) for p in self.excluded):
            raise refuse(NAME, "ignore / exclude_modules must be lists of module names")
        groups = qc.get("config_groups") or {}
        if not isinstance(groups, dict):
            raise refuse(NAME, "config_groups must be an object")
        for group, spec in groups.items():
            unknown = sorted(set(spec) - GROUP_KEYS) if isinstance(spec, dict) else ["(not an object)"]
            if unknown:
                raise refuse(NAME, f"config_groups.{group}.{unknown[0]} is not honoured by stagemesh")
            _fp8_args(algo, f"config_groups.{group}.weights", spec.get("weights"))
            _fp8_args(algo, f"config_groups.{group}.input_activations", spec.get("input_activations"))

    def describe(self) -> str:
        return f"{NAME} {self.algo}"

    def quantised(self, prefix, reader):
        return not any(fnmatch(prefix, p) or p in prefix for p in self.excluded)

    def read(self, reader, prefix, dim, start, length):
        total_rows, _ = reader.shape(f"{prefix}.weight")
        q = read_fp8(NAME, reader, f"{prefix}.weight", dim, start, length)
        name = f"{prefix}.weight_scale"
        shape = reader.shape(name)
        if self.algo == "FP8" and shape not in ([], [1]):
            raise refuse(NAME, f"{name} has shape {shape}; quant_algo FP8 stores one scale a tensor")
        scales = channel_scales(NAME, reader, name, rows_of(dim, start, length, total_rows), total_rows)
        part = Part(q, torch.zeros(q.shape[1], dtype=torch.int64), scales, None, 8,
                    "modelopt fp8 tensor" if self.algo == "FP8" else "modelopt fp8 channel")
        if self.algo == "FP8":
            scale = f"{prefix}.input_scale"
            if not reader.has(scale):
                raise refuse(NAME, f"quant_algo FP8 quantises activations statically with {scale}, which the "
                                   "checkpoint lacks")
            part.activation, part.input_scale = "fp8", scalar(NAME, scale, reader.read_whole(scale))
        return part


METHOD = ModelOpt
