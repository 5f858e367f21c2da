"""gptq (AutoGPTQ / GPTQModel / transformers' GPTQConfig): `bits` 4 or 8 integers packed along K into int32
`qweight` [K * bits / 32, N], per group of `group_size` input columns (-1: one group) fp16 `scales`
[groups, N] and packed `qzeros` [groups, N * bits / 32], and `g_idx` [K], each input column's group
(desc_act: the columns were quantised in another order, so a group's columns lie anywhere in the row).
w[n, k] = scales[g, n] * (q[k, n] - z[g, n]), g = g_idx[k]; the "gptq" checkpoint format stores z - 1 (so a
symmetric 4-bit checkpoint stores 7 for 8), "gptq_v2" stores z. 8-bit weights must be symmetric (z = 128).
Which linears are quantised: those whose qweight the checkpoint holds (the rest are dense)."""
from __future__ import annotations

import torch

from stage_worker.quant_methods.method import Part, QuantMethod, check_scales, expect_shape, field, refuse
from stage_worker.quant_methods.packing import unpack_int32

NAME = "gptq"
# the quantizer's settings and its kernel choices: how the weights were found or will be run, not what they mean
INFORMATIONAL = {"damp_percent", "damp_auto_increment", "true_sequential", "static_groups", "model_name_or_path",
                 "model_file_base_name", "meta", "tokenizer", "dataset", "use_cuda_fp16", "model_seqlen",
                 "block_name_to_quantize", "module_name_preceding_first_block", "batch_size", "pad_token_id",
                 "use_exllama", "disable_exllama", "exllama_config", "max_input_length", "cache_block_outputs",
                 "modules_in_block_to_quantize", "backend", "mse", "pack_dtype", "quant_method"}


class GPTQ(QuantMethod):
    name = NAME
    fields = frozenset({"bits", "group_size", "desc_act", "sym", "checkpoint_format", "format", "lm_head",
                        "dynamic"} | INFORMATIONAL)

    def __init__(self, qc):
        super().__init__(qc)
        self.bits = field(qc, NAME, "bits", (4, 8))
        group = qc.get("group_size", -1)
        if not isinstance(group, int) or not (group == -1 or group > 0):
            raise refuse(NAME, f"group_size = {group!r} must be -1 (one group a row) or a positive integer")
        self.group = group
        self.sym = field(qc, NAME, "sym", (True, False), True)
        field(qc, NAME, "desc_act", (True, False), False)  # (g_idx says where each column's group is, either way)
        fmt = qc.get("checkpoint_format", qc.get("format", "gptq"))
        self.v2 = field({"checkpoint_format": fmt}, NAME, "checkpoint_format", ("gptq", "gptq_v2")) == "gptq_v2"
        if qc.get("dynamic"):
            raise refuse(NAME, "dynamic (GPTQModel's per-module overrides) is not built")
        field(qc, NAME, "pack_dtype", ("int32",), "int32")
        if self.bits == 8 and not self.sym:
            raise refuse(NAME, "sym = false with bits = 8 is not built (8-bit weights must be symmetric)")

    def quantised(self, prefix, reader):
        return reader.has(f"{prefix}.qweight")

    def read(self, reader, prefix, dim, start, length):
        per = 32 // self.bits
        words, width_n = reader.shape(f"{prefix}.qweight")
        k = words * per
        groups = 1 if self.group == -1 else -(-k // self.group)
        expect_shape(NAME, f"{prefix}.scales", reader.shape(f"{prefix}.scales"), [groups, width_n])
        expect_shape(NAME, f"{prefix}.qzeros", reader.shape(f"{prefix}.qzeros"), [groups, -(-width_n // per)])
        gid = self._g_idx(reader, prefix, k, groups)
        if dim == 1:  # input columns: whole words of qweight
            if start % per or length % per:
                raise refuse(NAME, f"{prefix}.qweight: a TP shard of columns {start}:{start + length} splits its "
                                   f"int32 words of {per}")
            q = unpack_int32(reader.read_slice(f"{prefix}.qweight", 0, start // per, length // per), self.bits, 0)
            scales = reader.read_whole(f"{prefix}.scales").float()
            zeros = unpack_int32(reader.read_whole(f"{prefix}.qzeros"), self.bits, 1)[:, :width_n]
            gid = gid[start:start + length]
        else:  # output rows: columns of qweight, scales and (packed) qzeros
            q = unpack_int32(reader.read_slice(f"{prefix}.qweight", 1, start, length), self.bits, 0)
            scales = reader.read_slice(f"{prefix}.scales", 1, start, length).float()
            first, last = start // per, -(-(start + length) // per)
            zeros = unpack_int32(reader.read_slice(f"{prefix}.qzeros", 1, first, last - first), self.bits, 1)
            zeros = zeros[:, start - first * per:start - first * per + length]
        check_scales(NAME, f"{prefix}.scales", scales)
        z = zeros.float().T.contiguous() + (0 if self.v2 else 1)
        q, scales = q.T.contiguous(), scales.T.contiguous()
        kind = f"gptq int{self.bits} g{self.group}"
        if self.bits == 8:
            if not torch.all(z == 128):
                raise refuse(NAME, f"{prefix}.qzeros: 8-bit zero points other than 128 (asymmetric) are not built")
            return Part((q.to(torch.int16) - 128).to(torch.int8), gid, scales, None, 8, kind)
        return Part(q, gid, scales, z, 4, kind)

    def _g_idx(self, reader, prefix: str, k: int, groups: int) -> torch.Tensor:
        name = f"{prefix}.g_idx"
        if not reader.has(name):
            if self.qc.get("desc_act"):
                raise refuse(NAME, f"desc_act is true and the checkpoint has no {name}")
            return torch.arange(k) // (k if self.group == -1 else self.group)
        g_idx = reader.read_whole(name).to(torch.int64)
        expect_shape(NAME, name, g_idx.shape, [k])
        if g_idx.numel() and (int(g_idx.min()) < 0 or int(g_idx.max()) >= groups):
            raise refuse(NAME, f"{name} holds groups outside 0..{groups - 1} (group_size {self.group}, {k} columns)")
        return g_idx


METHOD = GPTQ
