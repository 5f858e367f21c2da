"""awq (AutoAWQ's GEMM checkpoints, transformers' AwqConfig): 4-bit integers packed eight to an int32 along
the output dimension in AWQ's interleaved order (field i of a word holds column ORDER[i] of its eight),
`qweight` [K, N / 8], `qzeros` [K / group_size, N / 8] packed the same way, fp16 `scales` [K / group_size, N]:
w[n, k] = scales[g, n] * (q[k, n] - z[g, n]), g = k // group_size. `modules_to_not_convert`: dense."""
from __future__ import annotations

import torch

from stage_worker.quant_methods.method import Part, QuantMethod, check_scales, expect_shape, field, refuse
from stage_worker.quant_methods.packing import unpack_int32

NAME = "awq"
ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's pack order: field i of a word holds column ORDER[i]
PER = 8


class AWQ(QuantMethod):
    name = NAME
    bits = 4
    fields = frozenset({"bits", "group_size", "zero_point", "version", "modules_to_not_convert", "backend",
                        "do_fuse", "fuse_max_seq_len", "exllama_config"})  # (the last four: AutoAWQ's kernel choice)

    def __init__(self, qc):
        super().__init__(qc)
        field(qc, NAME, "bits", (4,), 4)
        field(qc, NAME, "zero_point", (True,), True)
        version = qc.get("version", "gemm")
        field({"version": version.lower() if isinstance(version, str) else version}, NAME, "version", ("gemm",))
        group = qc.get("group_size", 128)
        if not isinstance(group, int) or group <= 0:
            raise refuse(NAME, f"group_size = {group!r} must be a positive integer")
        self.group = group

    def quantised(self, prefix, reader):
        return reader.has(f"{prefix}.qweight")

    def read(self, reader, prefix, dim, start, length):
        k, words = reader.shape(f"{prefix}.qweight")
        n = words * PER
        groups = -(-k // self.group)
        expect_shape(NAME, f"{prefix}.scales", reader.shape(f"{prefix}.scales"), [groups, n])
        expect_shape(NAME, f"{prefix}.qzeros", reader.shape(f"{prefix}.qzeros"), [groups, words])
        cols = torch.arange(k)
        if dim == 0:  # output rows: whole words along N
            if start % PER or length % PER:
                raise refuse(NAME, f"{prefix}.qweight: a TP shard of rows {start}:{start + length} splits its int32 "
                                   f"words of {PER}")
            w = (start // PER, length // PER)
            q = unpack_int32(reader.read_slice(f"{prefix}.qweight", 1, *w), 4, 1, ORDER)
            zeros = unpack_int32(reader.read_slice(f"{prefix}.qzeros", 1, *w), 4, 1, ORDER)
            scales = reader.read_slice(f"{prefix}.scales", 1, start, length).float()
        else:  # input columns
            q = unpack_int32(reader.read_slice(f"{prefix}.qweight", 0, start, length), 4, 1, ORDER)
            zeros = unpack_int32(reader.read_whole(f"{prefix}.qzeros"), 4, 1, ORDER)
            scales = reader.read_whole(f"{prefix}.scales").float()
            cols = cols[start:start + length]
        check_scales(NAME, f"{prefix}.scales", scales)
        return Part(q.T.contiguous(), cols // self.group, scales.T.contiguous(), zeros.float().T.contiguous(), 4,
                    f"awq int4 g{self.group}")


METHOD = AWQ
