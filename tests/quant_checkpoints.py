"""Tiny quantised checkpoints written as each quantizer writes them (tensor names, dtypes, packing, config),
and their dequantised twins: the same model with every quantised weight replaced by the float32 numbers its
format means (w = s * (q - z)), for transformers to be the reference.

The packing follows each quantizer's own code: compressed-tensors' pack_to_int32 (offset codes, low bits
first along K), AutoGPTQ's pack (qweight along K, qzeros along N, zeros stored minus one), AutoAWQ's GEMM
pack (along N in the order 0 2 4 6 1 3 5 7), DeepSeek-V3's weight_scale_inv per block (a partial block's scale
from its zero-padded block, as DeepSeek's README says).
"""
from __future__ import annotations

import json
import re
import shutil
import zlib
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from stage_worker.quant_methods.packing import pack_int32

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj",
           # DeepSeek's latent attention and shared experts (its gate, norms, embeddings and MTP eh_proj stay dense)
           "self_attn.q_a_proj", "self_attn.q_b_proj", "self_attn.kv_a_proj_with_mqa", "self_attn.kv_b_proj",
           "mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj", "mlp.shared_experts.down_proj")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
FP8_MAX = 448.0

# the formats tests write: name -> (quantization_config, how each linear is written)
FORMATS = ("ct-fp8-channel", "ct-fp8-tensor-static", "ct-fp8-block", "ct-int8", "ct-w4a16", "fbgemm-fp8",
           "fp8-block", "modelopt-fp8", "modelopt-fp8-pcpt", "gptq-int4", "gptq-int4-desc-act", "gptq-int4-asym",
           "gptq-int8", "awq")
# formats whose activations the checkpoint quantises statically (to fp8, with INPUT_SCALE)
STATIC_FP8 = ("ct-fp8-tensor-static", "modelopt-fp8")
# ModelOpt's older checkpoints: the config in hf_quant_config.json, none in config.json
HF_QUANT_CONFIG = ("modelopt-fp8-pcpt",)


def _fp8(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (w / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def _ct_group(weights: dict, strategy: str, activations: dict | None, fmt: str, **extra) -> dict:
    args = {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None, "strategy": strategy,
            "block_structure": None, "dynamic": False, "actorder": None, "observer": "minmax", "observer_kwargs": {}}
    return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
            "global_compression_ratio": 1.5, "ignore": ["lm_head", "re:.*mlp.gate$"], "kv_cache_scheme": None,
            "sparsity_config": {},
            "version": "0.9.1", "config_groups": {"group_0": {"targets": ["Linear"], "output_activations": None,
                                                              "weights": {**args, **weights},
                                                              "input_activations": activations}}, **extra}


DYNAMIC_TOKEN = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True, "strategy": "token",
                 "group_size": None, "block_structure": None, "actorder": None, "observer": None,
                 "observer_kwargs": {}}
STATIC_TENSOR = {**DYNAMIC_TOKEN, "dynamic": False, "strategy": "tensor", "observer": "minmax"}
INPUT_SCALE = 0.02  # static activations: |x| past 448 * 0.02 saturates (the tiny models' do not reach it)


def config_of(fmt: str, block: int = 32) -> dict:
    if fmt == "ct-fp8-channel":
        return _ct_group({"strategy": "channel"}, "channel", DYNAMIC_TOKEN, "float-quantized")
    if fmt == "ct-fp8-tensor-static":
        return _ct_group({"strategy": "tensor"}, "tensor", STATIC_TENSOR, "float-quantized")
    if fmt == "ct-fp8-block":
        return _ct_group({"strategy": "block", "block_structure": [32, 32]}, "block", DYNAMIC_TOKEN, "float-quantized")
    if fmt == "ct-int8":
        return _ct_group({"type": "int", "strategy": "channel"}, "channel", {**DYNAMIC_TOKEN, "type": "int"},
                         "int-quantized")
    if fmt == "ct-w4a16":
        return _ct_group({"type": "int", "num_bits": 4, "strategy": "group", "group_size": 32}, "group", None,
                         "pack-quantized")
    if fmt == "fbgemm-fp8":
        return {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0,
                "modules_to_not_convert": ["lm_head", "model.layers.1.self_attn"]}
    if fmt == "modelopt-fp8":  # config.json as ModelOpt >= 0.29 writes it: the scheme again as config_groups
        fp8 = {"dynamic": False, "num_bits": 8, "type": "float"}
        return {"quant_method": "modelopt", "quant_algo": "FP8", "ignore": ["lm_head"],
                "producer": {"name": "modelopt", "version": "0.33.0"}, "kv_cache_scheme": None,
                "config_groups": {"group_0": {"targets": ["Linear"], "weights": fp8, "input_activations": fp8}}}
    if fmt == "modelopt-fp8-pcpt":  # hf_quant_config.json's form (write_quantized moves it there)
        return {"producer": {"name": "modelopt", "version": "0.19.0"},
                "quantization": {"quant_algo": "FP8_PER_CHANNEL_PER_TOKEN", "kv_cache_quant_algo": None,
                                 "exclude_modules": ["lm_head", "model.layers.1.mlp*"]}}
    if fmt == "fp8-block":
        return {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                "weight_block_size": [block, block]}
    if fmt.startswith("gptq"):
        return {"quant_method": "gptq", "bits": 8 if fmt == "gptq-int8" else 4,
                "group_size": -1 if fmt == "gptq-int8" else 32, "desc_act": fmt == "gptq-int4-desc-act",
                "sym": fmt != "gptq-int4-asym", "damp_percent": 0.01, "true_sequential": True,
                "static_groups": False, "checkpoint_format": "gptq", "model_name_or_path": None,
                "model_file_base_name": None, "lm_head": False}
    if fmt == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm",
                "modules_to_not_convert": None, "backend": "autoawq"}
    raise ValueError(fmt)


def _fp8_linear(w: torch.Tensor, fmt: str, prefix: str, b: int = 32) -> tuple[dict, torch.Tensor]:
    """(tensors, dequantised weight) of an fp8 format (`b`: fp8-block's blocks, b x b)."""
    if fmt in ("ct-fp8-block", "fp8-block"):
        n, k = w.shape  # a weight not a whole number of blocks: zero-padded to one to take its scales (DeepSeek's)
        padded = torch.nn.functional.pad(w, (0, -k % b, 0, -n % b))
        blocks = padded.reshape(-(-n // b), b, -(-k // b), b).abs().amax((1, 3))
        scale = blocks / FP8_MAX
        full = scale.repeat_interleave(b, 0).repeat_interleave(b, 1)[:n, :k]
        q = _fp8(w, full)
        name = "weight_scale_inv" if fmt == "fp8-block" else "weight_scale"
        return {f"{prefix}.weight": q, f"{prefix}.{name}": scale}, q.float() * full
    scale = w.abs().amax() / FP8_MAX if fmt in STATIC_FP8 else w.abs().amax(1, keepdim=True) / FP8_MAX
    q = _fp8(w, scale)
    stored = scale.reshape(1) if scale.dim() == 0 else scale
    if fmt.startswith("modelopt"):  # ModelOpt's scales: [] a tensor, [N] a channel
        stored = scale.reshape(()) if fmt == "modelopt-fp8" else scale.reshape(-1)
    out = {f"{prefix}.weight": q, f"{prefix}.weight_scale": stored}
    if fmt in STATIC_FP8:
        input_scale = torch.tensor([INPUT_SCALE])
        out[f"{prefix}.input_scale"] = input_scale.reshape(()) if fmt == "modelopt-fp8" else input_scale
    return out, q.float() * scale


def _int_groups(w: torch.Tensor, bits: int, group: int, sym: bool, gen: torch.Generator):
    """(codes 0..2^bits-1 [N, K], scales [N, G], zeros [N, G]) in quantisation order of contiguous groups."""
    n, k = w.shape
    g = w.reshape(n, k // group, group)
    top = (1 << bits) - 1
    if sym:
        scales = g.abs().amax(-1) / (top / 2)
        zeros = torch.full_like(scales, float(1 << (bits - 1)))
    else:
        lo, hi = g.amin(-1), g.amax(-1)
        scales = (hi - lo) / top
        zeros = torch.randint(1, top + 1, scales.shape, generator=gen).float()  # GPTQ v1 cannot store a zero of 0
    codes = torch.round(g / scales[..., None] + zeros[..., None]).clamp(0, top)
    return codes.reshape(n, k).to(torch.uint8), scales.half().float(), zeros


def _int_linear(w: torch.Tensor, fmt: str, prefix: str, gen: torch.Generator) -> tuple[dict, torch.Tensor]:
    n, k = w.shape
    if fmt == "ct-int8":
        scale = w.abs().amax(1, keepdim=True) / 127
        q = torch.round(w / scale).clamp(-128, 127).to(torch.int8)
        return {f"{prefix}.weight": q, f"{prefix}.weight_scale": scale}, q.float() * scale
    bits = 8 if fmt == "gptq-int8" else 4
    group = k if fmt == "gptq-int8" else 32
    codes, scales, zeros = _int_groups(w, bits, group, fmt != "gptq-int4-asym", gen)
    g_idx = torch.arange(k) // group
    if fmt == "gptq-int4-desc-act":  # columns quantised in another order: group i of that order
        # (GPTQ's order comes from its input's statistics: q, k and v share theirs, so do gate and up)
        shared = prefix.replace("k_proj", "q_proj").replace("v_proj", "q_proj").replace("up_proj", "gate_proj")
        order = torch.randperm(k, generator=torch.Generator().manual_seed(zlib.crc32(shared.encode())))
        codes_sorted, scales, zeros = _int_groups(w[:, order], bits, group, True, gen)
        codes = torch.empty_like(codes_sorted)
        codes[:, order] = codes_sorted
        g_idx = torch.empty(k, dtype=torch.int64)
        g_idx[order] = torch.arange(k) // group
    deq = scales[:, g_idx] * (codes.float() - zeros[:, g_idx])
    if fmt == "ct-w4a16":
        signed = (codes.to(torch.int16) - 8)  # compressed-tensors quantises to -8..7 and packs value + 8
        return {f"{prefix}.weight_packed": pack_int32((signed + 8).to(torch.uint8), 4, 1),
                f"{prefix}.weight_scale": scales.half(),
                f"{prefix}.weight_shape": torch.tensor([n, k], dtype=torch.int64)}, deq
    if fmt == "awq":
        return {f"{prefix}.qweight": pack_int32(codes.T, 4, 1, AWQ_ORDER),
                f"{prefix}.qzeros": pack_int32(zeros.T.to(torch.uint8), 4, 1, AWQ_ORDER),
                f"{prefix}.scales": scales.T.half()}, deq
    return {f"{prefix}.qweight": pack_int32(codes.T, bits, 0),  # GPTQ: along K, zeros minus one along N
            f"{prefix}.qzeros": pack_int32((zeros - 1).T.to(torch.uint8), bits, 1),
            f"{prefix}.scales": scales.T.half(), f"{prefix}.g_idx": g_idx.to(torch.int32)}, deq


def _linear(prefix: str) -> bool:
    """An attention or MLP linear, or an expert's (a mixture of experts' routers stay dense)."""
    return prefix.split(".", 3)[-1] in LINEARS or re.search(r"\.experts\.\d+\.(gate|up|down)_proj$", prefix) is not None


def _skipped(fmt: str, prefix: str) -> bool:
    return (fmt == "fbgemm-fp8" and ".layers.1.self_attn." in prefix + ".") or \
        (fmt == "modelopt-fp8-pcpt" and ".layers.1.mlp." in prefix + ".")


def write_quantized(model_dir: str | Path, target: str | Path, fmt: str, seed: int = 0,
                    block: int = 32) -> tuple[Path, Path]:
    """(quantised checkpoint, dequantised twin) of the float32 model in model_dir, in `fmt` (FORMATS; fp8-block's
    blocks `block` x `block`)."""
    source, target = Path(model_dir), Path(target)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for f in source.glob("*.safetensors"):
        tensors.update(load_file(f))
    out, dense = {}, {}
    for name, t in tensors.items():
        prefix = name.removesuffix(".weight")
        if not (name.endswith(".weight") and _linear(prefix)) or _skipped(fmt, prefix):
            out[name] = dense[name] = t
            continue
        written, deq = (_fp8_linear(t, fmt, prefix, block) if "fp8" in fmt else _int_linear(t, fmt, prefix, gen))
        out.update(written)
        dense[name] = deq.float()
    quantised, twin = _write_pair(source, target, out, dense, config_of(fmt, block))
    if fmt in HF_QUANT_CONFIG:
        config = json.loads((quantised / "config.json").read_text())
        (quantised / "hf_quant_config.json").write_text(json.dumps(config.pop("quantization_config"), indent=4))
        (quantised / "config.json").write_text(json.dumps(config))
    return quantised, twin


def _write_pair(source: Path, target: Path, out: dict, dense: dict, qc: dict) -> tuple[Path, Path]:
    """target/quantised (the tensors `out`, config.json with quantization_config `qc`) and target/dequantised
    (`dense`, no quantization_config), each with the other files of the model in `source`."""
    quantised, twin = target / "quantised", target / "dequantised"
    config = json.loads((source / "config.json").read_text())
    for path, tensors_of, quant in ((quantised, out, qc), (twin, dense, None)):
        path.mkdir(parents=True, exist_ok=True)
        for f in source.iterdir():
            if f.is_file() and f.name != "config.json" and not f.name.endswith(".safetensors") \
                    and not f.name.endswith(".index.json"):
                shutil.copy(f, path / f.name)
        (path / "config.json").write_text(json.dumps({**config, **({"quantization_config": quant} if quant else {})}))
        save_file({k: v.contiguous() for k, v in tensors_of.items()}, path / "model.safetensors",
                  metadata={"format": "pt"})
    return quantised, twin


def static_activation_hooks(model, scale: float = INPUT_SCALE) -> None:
    """transformers' model as a static fp8 activation scheme computes it: every quantised linear's input
    x / s cast to float8_e4m3fn (saturated), times s."""
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.split(".", 3)[-1] in LINEARS:
            module.register_forward_pre_hook(
                lambda _m, args: ((args[0] / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * scale,))


MXFP4_CONFIG = {"quant_method": "mxfp4",  # as OpenAI's gpt-oss checkpoints say it
                "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                           "model.embed_tokens", "lm_head"]}


def write_mxfp4(model_dir: str | Path, target: str | Path) -> tuple[Path, Path]:
    """(MXFP4 checkpoint, dequantised twin) of the float32 gpt-oss in model_dir, as OpenAI's is written: each
    layer's stacked experts gate_up_proj [E, H, 2I] and down_proj [E, I, H] as `_blocks` and `_scales` of their
    transposes ([E, out, in / 32, 16] and [E, out, in / 32]); everything else as it is."""
    from stage_worker.quant_methods.mxfp4 import dequantise, quantise

    source, target = Path(model_dir), Path(target)
    tensors = {k: v for f in source.glob("*.safetensors") for k, v in load_file(f).items()}
    out, dense = {}, {}
    for name, t in tensors.items():
        if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            out[name] = dense[name] = t
            continue
        packed = [quantise(w.T.contiguous()) for w in t]  # per expert: [out, in]
        out[f"{name}_blocks"] = torch.stack([b for b, _ in packed])
        out[f"{name}_scales"] = torch.stack([s for _, s in packed])
        dense[name] = torch.stack([dequantise(b, s, torch.float32).T for b, s in packed])
    return _write_pair(source, target, out, dense, MXFP4_CONFIG)
