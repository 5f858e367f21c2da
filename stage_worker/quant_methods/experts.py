"""A mixture-of-experts layer's quantised experts: each expert this rank holds as two QuantizedWeights (its
gate and up rows merged, its down), read as the method reads any linear (its TP or EP share), and run one
expert at a time on the tokens routed to it (the fused experts' kernels take dense weights)."""
from __future__ import annotations

import torch
from torch import nn

import kernels
from stagemesh.core.errors import StagemeshError
from stage_worker.quant_methods.assemble import assemble
from stage_worker.quant_methods.method import QuantMethod
from stage_worker.quant_weight import QuantizedWeight


class QuantizedExperts(nn.Module):
    """Experts expert_start.. of a rank: w13[e] = cat(gate, up) [2 * inter, hidden], w2[e] = down [hidden, inter]."""

    def __init__(self, w13: list[QuantizedWeight], w2: list[QuantizedWeight]):
        super().__init__()
        self.w13, self.w2 = nn.ModuleList(w13), nn.ModuleList(w2)

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                expert_start: int) -> torch.Tensor:
        """fused_moe's contract (kernels/moe_reference.py): the experts this rank holds applied to the tokens
        routed to them, weighted, summed in fp32; slots routed elsewhere add nothing."""
        out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
        local = topk_ids - expert_start
        for e, (w13, w2) in enumerate(zip(self.w13, self.w2)):
            tokens, k = (local == e).nonzero(as_tuple=True)
            if not tokens.numel():
                continue
            y = w2.linear(kernels.silu_and_mul(w13.linear(x[tokens])))  # type: ignore[operator]
            out.index_add_(0, tokens, y.float() * topk_weights[tokens, k, None])
        return out.to(x.dtype)


def load_experts(block, method: QuantMethod, reader) -> bool:
    """The block's experts read quantised into block.quantised (its dense w13 / w2 go); False where the
    checkpoint holds them dense."""
    gate, up, down = block.names
    p = block.placement
    if not method.quantised(f"{block.block}.experts.{p.slots[0]}.{gate}", reader):
        return False
    if block.expert_map is not None:
        raise StagemeshError(f"{block.block}: EPLB with quantised experts ({method.name}) is not built yet")
    hidden, device = block.w13.shape[2], block.w13.device
    w13, w2 = [], []
    for e in p.slots:
        pre = f"{block.block}.experts.{e}"
        rows = [(0, method.read(reader, f"{pre}.{gate}", 0, p.inter_start, p.inter_size)),
                (p.inter_size, method.read(reader, f"{pre}.{up}", 0, p.inter_start, p.inter_size))]
        w13.append(assemble(f"{pre}.{gate}+{up}", 2 * p.inter_size, hidden, rows))
        w2.append(assemble(f"{pre}.{down}", hidden, p.inter_size,
                           [(0, method.read(reader, f"{pre}.{down}", 1, p.inter_start, p.inter_size))]))
    del block.w13, block.w2
    block.quantised = QuantizedExperts(w13, w2).to(device)
    return True
