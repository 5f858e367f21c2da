"""mxfp4 (OpenAI's gpt-oss checkpoints, transformers' Mxfp4Config): the experts' weights in MXFP4, OCP's
microscaling 4-bit float. Each stacked expert tensor of gpt-oss is two: `{proj}_blocks` uint8 [E, rows, K / 32, 16],
two e2m1 values a byte (the low nibble the even column), and `{proj}_scales` uint8 [E, rows, K / 32], an e8m0
exponent per 32 values (2^(s - 127)); rows are the product's outputs (gate_up_proj: the interleaved gate and up
columns, down_proj: the hidden size) and K its inputs, so the stacked bf16 tensor is the dequantised one
transposed, as transformers' convert_moe_packed_tensors gives it. The attention, router, embeddings and head stay
bf16 (the published `modules_to_not_convert`).

The experts stay packed (4.25 bits a weight) and an expert is dequantised when a step routes tokens to it, for that
product only (stage_worker.gpt_oss): no bf16 copy of the experts is ever held."""
from __future__ import annotations

import re

import torch
from torch import nn

from stagemesh.core.model_config import ModelConfig
from stage_worker.layers import Module, Shard, new_param
from stage_worker.quant_methods.method import QuantMethod, refuse

NAME = "mxfp4"
GROUP = 32  # values per e8m0 scale
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


class Mxfp4(QuantMethod):
    name = NAME
    bits = 4
    fields = frozenset({"modules_to_not_convert"})
    family_only = True  # gpt-oss's experts (stagemesh.core.families.gpt_oss names it)
    plan_dtype = "mxfp4"  # (stagemesh.entry.plan.memory: the experts packed, the rest bf16)

    def __init__(self, qc):
        super().__init__(qc)
        skip = qc.get("modules_to_not_convert") or []
        if not isinstance(skip, list) or not all(isinstance(p, str) for p in skip):
            raise refuse(NAME, f"modules_to_not_convert = {skip!r} must be a list of module names or patterns")
        self.skip = skip

    def quantised(self, prefix, reader):
        return False  # no linear: the experts' packed tensors are their layer's own (packed_experts)

    def packs(self, module: str) -> bool:
        """Whether the experts `module` (model.layers.{i}.mlp.experts) are MXFP4 in the checkpoint: unless
        modules_to_not_convert names them, as transformers' should_convert_module reads its patterns (the name, a
        dotted prefix or suffix of it, or a regex matching it: model.layers.*.self_attn)."""
        return not any(module == p or module.startswith(p + ".") or module.endswith("." + p)
                       or re.match(p.removeprefix("re:"), module) for p in self.skip)


METHOD = Mxfp4


def packed_experts(cfg: ModelConfig, module: str, start: int, per: int, device, first: int = 0,
                   local: int | None = None) -> "Mxfp4Experts | None":
    """The MXFP4 experts of `module` (this TP rank's intermediate columns start:start+per of every expert, or,
    expert parallel, the whole experts first:first+local), or None where the checkpoint holds them in bf16 (no
    quantization_config, or modules_to_not_convert names them)."""
    qc = cfg.raw.get("quantization_config")
    if not qc or qc.get("quant_method") != NAME or not Mxfp4(qc).packs(module):
        return None
    return Mxfp4Experts(module, cfg.num_experts, cfg.hidden_size, start, per, device, first, local)


class Mxfp4Experts(Module):
    """Every expert's gate_up and down, packed: blocks [E, rows, groups, 16] and scales [E, rows, groups]."""

    kind = "mxfp4 experts"  # (the stage's start-up line: stage_worker.quantization.describe)

    def __init__(self, module: str, num: int, hidden: int, start: int, per: int, device, first: int = 0,
                 local: int | None = None):
        super().__init__()
        if hidden % GROUP or start % GROUP or per % GROUP:
            raise refuse(NAME, f"{module}: this TP rank's intermediate columns {start}:{start + per} (of hidden size "
                               f"{hidden}) cut the 32-value blocks of down_proj; a TP size that gives each rank a "
                               "multiple of 32 is built")
        u8, g, local = torch.uint8, hidden // GROUP, num if local is None else local
        whole = local != num  # (expert parallel: whole experts, sliced along the experts)

        def packed(name: str, shape: tuple[int, ...], dim: int, first_col: int, length: int) -> nn.Parameter:
            shard = Shard(f"{module}.{name}", 0, first, local, 0) if whole else \
                Shard(f"{module}.{name}", dim, first_col, length, 0)
            return new_param((local, *shape), u8, device, [shard])

        self.gate_up_blocks = packed("gate_up_proj_blocks", (2 * per, g, 16), 1, 2 * start, 2 * per)
        self.gate_up_scales = packed("gate_up_proj_scales", (2 * per, g), 1, 2 * start, 2 * per)
        self.down_blocks = packed("down_proj_blocks", (hidden, per // GROUP, 16), 2, start // GROUP, per // GROUP)
        self.down_scales = packed("down_proj_scales", (hidden, per // GROUP), 2, start // GROUP, per // GROUP)

    def expert(self, e: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert e's gate_up [2 * per, hidden] and down [hidden, per] ([out, in], for F.linear), in `dtype`."""
        return (dequantise(self.gate_up_blocks[e], self.gate_up_scales[e], dtype),
                dequantise(self.down_blocks[e], self.down_scales[e], dtype))

    def nbytes(self) -> int:
        return sum(p.numel() for p in self.parameters())


def dequantise(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[rows, groups, 16] packed e2m1 and [rows, groups] e8m0 -> [rows, groups * 32] in `dtype` (exact: every
    MXFP4 value is a bf16 one)."""
    lut = torch.tensor(E2M1, dtype=torch.float32, device=blocks.device)
    values = torch.stack([lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]], -1)  # [rows, groups, 16, 2]
    exponents = scales.to(torch.int32) - 127
    w = torch.ldexp(values.reshape(*scales.shape, GROUP), exponents[..., None].float())
    return w.reshape(scales.shape[0], -1).to(dtype)


def quantise(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[rows, K] -> (blocks [rows, K / 32, 16], scales [rows, K / 32]) as OpenAI's checkpoints hold them: each 32
    values' exponent the smallest that brings them within e2m1's 6, each value the nearest e2m1 (tests write
    checkpoints with it)."""
    rows, k = w.shape
    groups = w.float().reshape(rows, k // GROUP, GROUP)
    amax = groups.abs().amax(-1).clamp(min=2.0 ** -126)
    exponents = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    scaled = groups / torch.ldexp(torch.ones_like(exponents), exponents.int())[..., None]
    lut = torch.tensor(E2M1)
    codes = (scaled[..., None] - lut).abs().argmin(-1).to(torch.uint8)  # [rows, groups, 32]
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks, (exponents + 127).to(torch.uint8)
