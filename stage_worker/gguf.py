"""Read a stage's tensors from a GGUF file, memory-mapped: only the rows (or whole 32-wide blocks of
columns) of its TP shard, the quantised ones re-laid into kernels/quant_reference.py's layouts as they are.

Served: Q4_0, Q4_1, Q4_K (its 256-wide super-blocks become eight groups of 32) and Q8_0 quantised,
F32 / F16 / BF16 dense; the families whose Family.gguf names their GGUF architecture (stagemesh.core.families:
llama files, for Llama, Mistral and SmolLM, have q and k rows un-permuted as transformers does, and qwen2 / qwen3).
The config and tokenizer come from a model directory.
"""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch

from stagemesh.core.errors import StagemeshError
from stagemesh.core.families import FAMILIES, GGUF
from stagemesh.core.model_config import ModelConfig

QUANTISED = ("Q4_0", "Q4_1", "Q4_K", "Q8_0")
DENSE = ("F32", "F16", "BF16")

def served_architectures() -> list[str]:
    """The GGUF architectures of the families served from GGUF files (stagemesh.core.families: Family.gguf)."""
    return sorted({f.gguf.architecture for f in FAMILIES.values() if f.gguf is not None})


_LAYER = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias", "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
}
_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}


def gguf_name(name: str, family: GGUF | None = None) -> str:
    """The GGUF name of a Hugging Face tensor name (`family`: the names its family declares first)."""
    if name in _GLOBAL:
        return _GLOBAL[name]
    match = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
    own = dict(family.tensor_names) if family is not None else {}
    if match and (match.group(2) in own or match.group(2) in _LAYER):
        return f"blk.{match.group(1)}.{own.get(match.group(2)) or _LAYER[match.group(2)]}"
    raise StagemeshError(f"no GGUF tensor corresponds to {name}")


def _unpermute(rows: int, heads: int) -> np.ndarray:
    """For each Hugging Face row of a llama q or k weight, its row in the GGUF (llama.cpp's converter
    interleaves the rotary halves of each head; transformers' GGUF loader undoes it the same way)."""
    dim = rows // heads // 2
    return np.arange(rows).reshape(heads, dim, 2).swapaxes(2, 1).reshape(rows)


def _f16(raw: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)[..., 0]


def convert_blocks(qtype: str, raw: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Rows of a quantised tensor's blocks ([rows, bytes]) -> (qs, scales, mins) of the kernels' layouts."""
    rows = raw.shape[0]
    if qtype == "Q8_0":
        b = raw.reshape(rows, -1, 34)
        qs = np.ascontiguousarray(b[..., 2:]).view(np.int8).reshape(rows, -1)
        return torch.from_numpy(qs), torch.from_numpy(_f16(b[..., :2])), None
    if qtype in ("Q4_0", "Q4_1"):
        size = 18 if qtype == "Q4_0" else 20
        b = raw.reshape(rows, -1, size)
        d = _f16(b[..., :2])
        m = -8.0 * d if qtype == "Q4_0" else _f16(b[..., 2:4])  # w = d (q - 8) = d q - 8 d, exactly
        qs = np.ascontiguousarray(b[..., size - 16:]).reshape(rows, -1)
        return torch.from_numpy(qs), torch.from_numpy(d), torch.from_numpy(m.astype(np.float32))
    if qtype == "Q4_K":
        from gguf.quants import Q4_K

        b = raw.reshape(rows, -1, 144)
        nb = b.shape[1]
        d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
        sc, mn = Q4_K.get_scale_min(np.ascontiguousarray(b[..., 4:16]).reshape(-1, 12))
        scales = d[..., None] * sc.reshape(rows, nb, 8).astype(np.float32)
        mins = -(dmin[..., None] * mn.reshape(rows, nb, 8).astype(np.float32))
        q: np.ndarray = b[..., 16:].reshape(rows, nb, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 1, 2, 1)
        q = (q & 0x0F).reshape(rows, nb * 8, 32)  # sub-block 2c: low nibbles of chunk c, 2c + 1: high
        qs = (q[..., :16] | (q[..., 16:] << 4)).reshape(rows, -1)
        return (torch.from_numpy(np.ascontiguousarray(qs)), torch.from_numpy(scales.reshape(rows, -1)),
                torch.from_numpy(mins.reshape(rows, -1)))
    raise StagemeshError(f"{qtype} is not a quantised type stagemesh serves ({', '.join(QUANTISED)})")


BLOCK = {"Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_1": (32, 20), "Q4_K": (256, 144)}  # weights, bytes a block


class GGUFCheckpoint:
    """The tensors of one GGUF file, memory-mapped; reads are slices of a TP shard."""

    def __init__(self, path: str | Path, cfg: ModelConfig):
        from gguf import GGUFReader

        self.path = Path(path)
        try:
            self.reader: GGUFReader | None = GGUFReader(self.path)  # None once closed
        except (OSError, ValueError, KeyError) as err:
            raise StagemeshError(f"{self.path} is not a readable GGUF file: {err}") from None
        self.tensors = {t.name: t for t in self.reader.tensors}
        arch = self._field("general.architecture")
        want = cfg.family.gguf
        if want is None or arch != want.architecture:
            raise StagemeshError(f"{self.path.name} holds a {arch!r} model and the config a {cfg.model_type}: "
                                 f"stagemesh serves GGUF files of {', '.join(served_architectures())} "
                                 "models with their own config")
        self.cfg, self.family = cfg, want
        self.permuted = want.permuted_qk

    def _field(self, key: str):
        assert self.reader is not None, "the file's fields are read while it is open (close() drops the reader)"
        field = self.reader.fields.get(key)
        if field is None:
            return None
        return bytes(field.parts[field.data[0]]).decode("utf-8", "replace")

    def _name(self, name: str) -> str:
        return gguf_name(name, self.family)

    def _tensor(self, name: str):
        tensor = self.tensors.get(self._name(name))
        if tensor is None:
            raise StagemeshError(f"{self.path.name} has no tensor {self._name(name)} (for {name})")
        return tensor

    def qtype(self, name: str) -> str:
        return self._tensor(name).tensor_type.name

    def is_quantised(self, name: str) -> bool:
        return self.qtype(name) in QUANTISED

    def shape(self, name: str) -> tuple[int, ...]:
        """In Hugging Face's order ([out, in] for a weight)."""
        return tuple(int(n) for n in reversed(self._tensor(name).shape))

    def _rows(self, name: str, start: int, length: int, rows: int) -> np.ndarray | slice:
        if not 0 <= start <= start + length <= rows:
            raise StagemeshError(f"{self._name(name)} has {rows} rows; the shard wants {start}:{start + length}")
        if self.permuted and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = self.cfg.num_attention_heads if "q_proj" in name else self.cfg.num_key_value_heads
            return _unpermute(rows, heads)[start:start + length]
        return slice(start, start + length)

    def read_slice(self, name: str, dim: int, start: int, length: int) -> torch.Tensor:
        """A dense slice (dequantised if the tensor is quantised), for the loader of plain parameters."""
        t, qtype = self._tensor(name), self.qtype(name)
        shape = self.shape(name)
        if qtype in QUANTISED:
            qs, scales, mins = self.read_quantised(name, dim, start, length)
            from kernels.quant_reference import dequantize

            return dequantize(qs, scales, mins)
        if qtype not in DENSE:
            raise StagemeshError(f"{self._name(name)} is {qtype}: stagemesh serves {', '.join(QUANTISED + DENSE)}")
        data = np.asarray(t.data).reshape(shape)
        if dim == 0:
            data = data[self._rows(name, start, length, shape[0])]
        else:
            data = data[:, start:start + length]
        if qtype == "BF16":
            return torch.from_numpy(np.ascontiguousarray(data).view(np.int16)).view(torch.bfloat16).float()
        return torch.from_numpy(np.array(data, dtype=np.float32))

    def read_quantised(self, name: str, dim: int, start: int, length: int):
        """(qs, scales, mins) of rows start:start+length (dim 0) or of columns start:start+length (dim 1,
        whole blocks of 32 only) of a quantised weight [out, in]."""
        t, qtype = self._tensor(name), self.qtype(name)
        rows, cols = self.shape(name)
        if dim == 1 and not 0 <= start <= start + length <= cols:
            raise StagemeshError(f"{self._name(name)} has {cols} columns; the shard wants {start}:{start + length}")
        per_block, size = BLOCK[qtype]
        raw = np.asarray(t.data).reshape(rows, cols // per_block * size)
        if dim == 0:
            return convert_blocks(qtype, raw[self._rows(name, start, length, rows)])
        if start % 32 or length % 32:
            raise StagemeshError(f"{self._name(name)}: a TP shard of columns {start}:{start + length} would split "
                                 "a quantisation block of 32 weights; choose a --tensor-parallel-size whose "
                                 "shards of this layer's inputs are multiples of 32")
        b0, b1 = start // per_block, -(-(start + length) // per_block)  # the file's blocks that cover the shard
        qs, scales, mins = convert_blocks(qtype, raw[:, b0 * size:b1 * size])
        g0 = (start - b0 * per_block) // 32  # the shard's groups of 32 among them
        g1, per_byte = g0 + length // 32, 2 if qs.dtype == torch.uint8 else 1
        qs = qs[:, g0 * 32 // per_byte:g1 * 32 // per_byte].contiguous()
        return qs, scales[:, g0:g1].contiguous(), None if mins is None else mins[:, g0:g1].contiguous()

    def close(self) -> None:
        self.tensors.clear()
        self.reader = None
