"""GGUF files of the tiny test models, and the model directory that is exactly their dequantised weights.

write_gguf lays a tiny model's tensors out as llama.cpp's converter does (GGUF names, q and k rows permuted
where the family says so) and quantises the linear weights with the `gguf` package's quantisers (Q4_0, Q4_1, Q8_0) or
quantize_q4_k below (gguf-py has no Q4_K quantiser; tests check it against gguf's dequantiser).
dequantised_model_dir is what transformers makes of such a file (the default model's fp32 directory is
made that way from its GGUF): the reference the GGUF path must agree with.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch

from stage_worker.gguf import gguf_name
from stagemesh.core.families import GGUF
from stagemesh.core.model_config import ModelConfig


def _gguf_family(cfg: dict) -> GGUF:
    """How llama.cpp lays out the model's family (its declaration in stagemesh.core.families)."""
    family = ModelConfig.from_dict(cfg).family.gguf
    assert family is not None, f"{cfg['model_type']} is not served from GGUF files"
    return family


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter: each head's rotary halves interleaved."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """transformers' GGUF loader: the inverse of _permute."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """A plain Q4_K quantiser (rows of multiples of 256 -> [rows, 144 bytes per 256]): per sub-block of 32
    a scale (max - min) / 15 and a min, both as 6-bit multiples of the super-block's f16 d and dmin."""
    rows, k = x.shape
    blocks = x.astype(np.float32).reshape(-1, 8, 32)
    lo, hi = np.minimum(blocks.min(-1), 0), blocks.max(-1)
    scale, mn = (hi - lo) / 15, -lo
    d = (scale.max(-1) / 63).astype(np.float16)
    dmin = (mn.max(-1) / 63).astype(np.float16)
    df, dminf = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    sc = np.clip(np.round(np.divide(scale, df, out=np.zeros_like(scale), where=df > 0)), 0, 63).astype(np.uint8)
    m = np.clip(np.round(np.divide(mn, dminf, out=np.zeros_like(mn), where=dminf > 0)), 0, 63).astype(np.uint8)
    eff_d, eff_m = (df * sc)[..., None], (dminf * m)[..., None]
    q = np.clip(np.round(np.divide(blocks + eff_m, eff_d, out=np.zeros_like(blocks), where=eff_d > 0)), 0, 15)
    q = q.astype(np.uint8)
    packed = np.empty((blocks.shape[0], 12), np.uint8)  # the inverse of gguf's Q4_K.get_scale_min
    packed[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    packed[:, 4:8] = m[:, :4] | ((m[:, 4:] >> 4) << 6)
    packed[:, 8:12] = (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4)
    qs = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(-1, 128)  # chunk c: sub-block 2c low, 2c + 1 high
    out = np.concatenate([d[:, None].view(np.uint8), dmin[:, None].view(np.uint8), packed, qs], axis=1)
    return out.reshape(rows, k // 256 * 144)


def _quantize(arr: np.ndarray, qtype: str):
    import gguf
    from gguf import quants

    kind = getattr(gguf.GGMLQuantizationType, qtype)
    data = quantize_q4_k(arr) if qtype == "Q4_K" else quants.quantize(arr, kind)
    return data, kind


def write_gguf(model_dir: Path, path: Path, qtype: str = "Q4_1", embed_qtype: str | None = "Q8_0") -> Path:
    """The tiny model in `model_dir` as a GGUF: every linear weight in qtype, the embedding (and LM head) in
    embed_qtype (None: F32), norms and biases F32."""
    import gguf
    from safetensors.torch import load_file

    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    family = _gguf_family(cfg)
    state = {}
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        state.update(load_file(file))
    writer = gguf.GGUFWriter(str(path), family.architecture)
    for name, tensor in sorted(state.items()):
        arr = tensor.float().numpy()
        if family.permuted_qk and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg["num_attention_heads"] if "q_proj" in name else cfg["num_key_value_heads"]
            arr = _permute(arr, heads)
        table = name in ("model.embed_tokens.weight", "lm_head.weight")
        want = embed_qtype if table else qtype if arr.ndim == 2 else None
        if want is None:
            writer.add_tensor(gguf_name(name, family), arr)
        else:
            data, kind = _quantize(arr, want)
            writer.add_tensor(gguf_name(name, family), data, raw_shape=data.shape, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def dequantised_model_dir(model_dir: Path, gguf_file: Path, out: Path) -> Path:
    """A copy of model_dir (config, tokenizer) whose weights are the GGUF's, dequantised with gguf's own
    dequantiser and un-permuted as transformers does: the reference for the GGUF path."""
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from safetensors.torch import save_file

    shutil.copytree(model_dir, out, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    names = {}
    from safetensors import safe_open

    for file in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            names.update({gguf_name(n, _gguf_family(cfg)): n for n in f.keys()})
    reader = GGUFReader(str(gguf_file))
    state = {}
    for t in reader.tensors:
        arr = dequantize(t.data, t.tensor_type).reshape(tuple(int(n) for n in reversed(t.shape)))
        name = names[t.name]
        if _gguf_family(cfg).permuted_qk and name.endswith(("q_proj.weight", "k_proj.weight")):
            arr = _unpermute(arr, cfg["num_attention_heads"] if "q_proj" in name else cfg["num_key_value_heads"])
        state[name] = torch.from_numpy(np.array(arr, dtype=np.float32))
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out
