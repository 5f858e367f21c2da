"""fbgemm_fp8 (transformers' FbgemmFp8Config; meta-llama/Llama-3.1-405B-FP8 is stored so): float8_e4m3fn
weights with a float32 scale per output channel (`weight_scale` [N, 1]), activations quantised per row at
run time with their scale capped by `activation_scale_ub`; `modules_to_not_convert` (and the LM head) dense.

The products are weight-only (x unrounded, as vLLM's Marlin fp8 path on GPUs without fp8 tensor cores), with
x clamped to +-activation_scale_ub, which is what the cap does to a row whose max exceeds it."""
from __future__ import annotations

from stage_worker.quant_methods.method import (Part, QuantMethod, channel_scales, matches, read_fp8, refuse,
                                               rows_of, scalar)

import torch


class FbgemmFp8(QuantMethod):
    name = "fbgemm_fp8"
    fields = frozenset({"activation_scale_ub", "modules_to_not_convert"})

    def __init__(self, qc):
        super().__init__(qc)
        ub = qc.get("activation_scale_ub", 1200.0)
        if not isinstance(ub, (int, float)) or not ub > 0:
            raise refuse(self.name, f"activation_scale_ub = {ub!r} must be a positive number")
        self.bound = float(ub)
        self.skip = list(qc.get("modules_to_not_convert") or [])

    plan_dtype = "fp8"

    def quantised(self, prefix, reader):
        return prefix != "lm_head" and not matches(self.skip, prefix)

    def read(self, reader, prefix, dim, start, length):
        total_rows, width = reader.shape(f"{prefix}.weight")
        q = read_fp8(self.name, reader, f"{prefix}.weight", dim, start, length)
        rows = rows_of(dim, start, length, total_rows)
        s = channel_scales(self.name, reader, f"{prefix}.weight_scale", rows, total_rows)
        bound = self.bound
        if reader.has(f"{prefix}.input_scale_ub"):  # transformers saves its copy of the cap
            bound = scalar(self.name, f"{prefix}.input_scale_ub", reader.read_whole(f"{prefix}.input_scale_ub"))
        return Part(q, torch.zeros(q.shape[1], dtype=torch.int64), s, None, 8, "fbgemm_fp8 channel",
                    input_bound=bound)


METHOD = FbgemmFp8
