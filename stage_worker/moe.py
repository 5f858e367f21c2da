"""The mixture-of-experts block of a sparse decoder layer: top-k routing (or DeepSeek's grouped gate,
stage_worker.grouped_gate), the experts this TP rank holds, and the shared expert (Qwen2-MoE's behind a sigmoid
gate, DeepSeek's added as is), ending in the layer's one all-reduce.

Which experts a rank holds is decided by the shard-aware parameters, not in the forward:
tensor parallel (default) shards every expert's intermediate size like a dense MLP; expert
parallel (--enable-expert-parallel) gives each rank whole experts, E / TP of them. Either way
each rank holds every token after attention's all-reduce, computes what its experts add to
every token routed to them, and one all-reduce sums the ranks (why: below).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

import kernels
from stagemesh.core.errors import StagemeshError
from stagemesh.core.model_config import ModelConfig
from stage_worker.eplb import EPLBConfig, ExpertMap, plan_placement
from stage_worker.grouped_gate import GroupedGate
from stage_worker.layers import MLP, Linear, Module, Shard, full, new_param
from stage_worker.parallel import TPGroup, shard_range
from stage_worker.weights import fill

# How tokens reach the ranks that own their experts, and the results come back. Every rank of
# a stage holds every token once attention's all-reduce is done, so no dispatch is needed: a
# rank runs its experts on the tokens routed to them, and one all-reduce of [tokens, hidden]
# both combines the top-k results and returns them to every rank (the next attention is TP).
# The all_to_all alternative (each token's results sent to one owner rank, summed there, then
# all-gathered) needs two collectives for the same bytes. Measured with benchmarks/bench_moe.py
# --collectives-only on the 2-core development VM (2 ranks, fp32 [32, 1024]: decode at batch 32,
# median of 2000, two runs, the machine shared): the stage's shared-memory all-reduce 0.025-0.065
# ms; gloo all-reduce 0.77-0.90 ms; gloo all_to_all + all-gather 1.3-2.1 ms; gloo reduce-scatter
# + all-gather 1.7-1.8 ms. So one all-reduce, through the shared memory the TP group already has.
# Across data-parallel replicas tokens are not replicated: stage_worker.ep_group gathers them (one
# all-gather), each member computes its experts' part for all, one all-reduce sums the members, and
# each keeps its rows. gloo has no reduce-scatter; an all_to_all pair would move fewer bytes at
# large K and is the next step on GPUs (NCCL), where the group's collectives are not built yet.


@dataclass(frozen=True)
class ExpertPlacement:
    """The expert slots one TP rank holds (physical ids expert_start.. expert_start + num_local_experts - 1,
    holding the logical experts `slots`) and the columns of their intermediate size it keeps."""

    expert_start: int
    num_local_experts: int
    inter_start: int
    inter_size: int
    slots: tuple[int, ...] = ()  # the logical expert in each slot (with EPLB, not expert_start + i)

    @classmethod
    def for_rank(cls, cfg: ModelConfig, tp: TPGroup, expert_parallel: bool, ep=None,
                 placement: list[list[int]] | None = None) -> "ExpertPlacement":
        if ep is not None:  # across the replicas: expert e on member e // (E / K) (the stage is TP=1)
            cfg.check_expert_parallel(ep.size, across_replicas=True)
            per = cfg.num_experts // ep.size
            first = ep.rank * per
            return cls(first, per, 0, cfg.moe_intermediate_size, tuple(range(first, first + per)))
        if placement is not None:  # EPLB: this rank's slots of the stage's placement
            per = len(placement[tp.rank])
            return cls(tp.rank * per, per, 0, cfg.moe_intermediate_size, tuple(placement[tp.rank]))
        if expert_parallel:  # expert e on rank e // (E / EP), EP size = TP size
            cfg.check_expert_parallel(tp.size)
            per = cfg.num_experts // tp.size
            first = tp.rank * per
            return cls(first, per, 0, cfg.moe_intermediate_size, tuple(range(first, first + per)))
        start, per = shard_range(cfg.moe_intermediate_size, tp, "moe_intermediate_size")
        return cls(0, cfg.num_experts, start, per, tuple(range(cfg.num_experts)))


def describe_layout(cfg: ModelConfig, tp_size: int, expert_parallel: bool, ep=None) -> str:
    """Which rank holds which experts, for the start-up log."""
    if ep is not None:
        per = cfg.num_experts // ep.size
        return (f"expert parallel across {ep.size} data-parallel replicas (EP={ep.size}, {per} of {cfg.num_experts} "
                f"experts per replica's stage): this one (DP rank {ep.rank}) holds experts {ep.rank * per}-"
                f"{(ep.rank + 1) * per - 1}")
    if not expert_parallel:
        return (f"tensor parallel: each of the {tp_size} rank(s) holds all {cfg.num_experts} experts, "
                f"{cfg.moe_intermediate_size // tp_size} of their {cfg.moe_intermediate_size} intermediate columns")
    per = cfg.num_experts // tp_size
    ranks = "; ".join(f"rank {r}: experts {r * per}-{(r + 1) * per - 1}" for r in range(tp_size))
    return f"expert parallel (EP={tp_size}, {per} of {cfg.num_experts} experts per rank): {ranks}"


def _checkpoint_names(cfg: ModelConfig, layer: int) -> tuple[str, tuple[str, str, str]]:
    """The block's prefix and its experts' (gate, up, down) names, as the checkpoint spells them."""
    experts = cfg.family.experts
    if experts is None:
        raise StagemeshError(f"{cfg.model_type} has no experts")
    return f"model.layers.{layer}.{experts.block}", experts.names


def _expert_shards(block: str, names: tuple[str, str, str], p: ExpertPlacement, local) -> tuple[list, list]:
    """The checkpoint slices of w13 and w2 for the (slot, logical expert) pairs `local`."""
    gate, up, down = names
    first, cols = p.inter_start, p.inter_size
    w13 = [shard for i, e in local for shard in (Shard(f"{block}.experts.{e}.{gate}.weight", 0, first, cols, 0, i),
                                                 Shard(f"{block}.experts.{e}.{up}.weight", 0, first, cols, cols, i))]
    w2 = [Shard(f"{block}.experts.{e}.{down}.weight", 1, first, cols, 0, i) for i, e in local]
    return w13, w2


def _expert_weights(block: str, names: tuple[str, str, str], p: ExpertPlacement, hidden: int, dtype, device):
    """w13 [slots, 2 * inter, hidden] = cat(gate, up) and w2 [slots, hidden, inter], this rank's part."""
    w13_shards, w2_shards = _expert_shards(block, names, p, list(enumerate(p.slots)))
    w13 = new_param((p.num_local_experts, 2 * p.inter_size, hidden), dtype, device, w13_shards)
    w2 = new_param((p.num_local_experts, hidden, p.inter_size), dtype, device, w2_shards)
    return w13, w2


class SparseMoeBlock(Module):
    """Router, this rank's experts (and the shared expert): what they add to every token, all-reduced."""

    expert_tokens: torch.Tensor | None  # a buffer (register_buffer below): TP rank 0's counts, None on other ranks

    def __init__(self, cfg: ModelConfig, layer: int, tp: TPGroup, expert_parallel: bool, dtype, device, ep=None,
                 eplb: EPLBConfig | None = None):
        super().__init__()
        block, names = _checkpoint_names(cfg, layer)
        self.block, self.names = block, names
        self.layer, self.tp, self.ep = layer, tp, ep  # ep: the stage_worker.ep_group.EPGroup, across replicas
        self.top_k, self.renormalize = cfg.num_experts_per_tok, cfg.norm_topk_prob
        # EPLB: the stage's placement (every rank's slots), and the map the forward sends tokens through
        self.expert_map: ExpertMap | None = None
        self.stage_placement: list[list[int]] | None = None
        self.balancedness = 1.0  # of the last window EPLB looked at
        self.eplb_rebalances = {"applied": 0, "kept": 0}  # EPLB's decisions for this layer (stage_worker.eplb)
        if eplb is not None:
            slots = (cfg.num_experts + eplb.num_redundant_experts) // tp.size
            self.stage_placement = plan_placement([1.0] * cfg.num_experts, tp.size, slots)
            self.expert_map = ExpertMap(cfg.num_experts, 1 + eplb.num_redundant_experts, device)
            self.expert_map.set(self.stage_placement)
        self.placement = ExpertPlacement.for_rank(cfg, tp, expert_parallel, ep, self.stage_placement)
        e, h = cfg.num_experts, cfg.hidden_size
        experts = cfg.family.experts
        assert experts is not None  # (_checkpoint_names refuses a family without)
        self.gate: Linear | GroupedGate  # the router: logits for kernels.select_experts, or DeepSeek's whole gate
        if experts.router == "grouped":
            self.gate = GroupedGate(cfg, block, device)
        else:
            self.gate = Linear(new_param((e, h), dtype, device, full(f"{block}.gate.weight", e)))
        self.w13, self.w2 = _expert_weights(block, names, self.placement, h, dtype, device)
        # a quantised checkpoint's experts, in w13's and w2's place (stage_worker.quant_methods.experts)
        self.quantised: nn.Module | None = None
        self.shared_expert: MLP | None = None
        self.shared_expert_gate: Linear | None = None  # Qwen2-MoE's sigmoid gate on the shared expert
        if cfg.shared_expert_intermediate_size:  # TP-sharded in both modes; its partial sums join the one all-reduce
            shared = f"{block}.{experts.shared}"
            self.shared_expert = MLP(shared, h, cfg.shared_expert_intermediate_size, tp, dtype, device, reduce=False)
            if experts.shared_gate:
                self.shared_expert_gate = Linear(new_param((1, h), dtype, device, full(f"{shared}_gate.weight", 1)))
        # tokens routed to each expert (TP rank 0 counts: routing is the same on every rank)
        counts = torch.zeros(e, dtype=torch.int64, device=device) if tp.rank == 0 else None
        self.register_buffer("expert_tokens", counts, persistent=False)

    def forward(self, x: torch.Tensor, meta) -> torch.Tensor:
        if self.ep is not None:
            return self._forward_across_replicas(x, meta)
        topk_weights, topk_ids = self._route(x)
        if self.expert_tokens is not None:
            self._count(self.expert_tokens, topk_ids, meta.slot_mapping)
        if self.expert_map is not None:  # to one copy of each expert
            topk_ids = self.expert_map.physical(topk_ids)
        out = self._experts(x, topk_weights, topk_ids)
        return self.tp.all_reduce(self._add_shared(out, x))

    def _route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's top-k weights (fp32) and experts (int64)."""
        if isinstance(self.gate, GroupedGate):
            return self.gate(x)
        return kernels.select_experts(self.gate(x), self.top_k, self.renormalize)

    def _add_shared(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        if self.shared_expert is None:
            return out
        shared = self.shared_expert(x)
        if self.shared_expert_gate is not None:
            shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
        return out + shared

    def _experts(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        if self.quantised is not None:
            return self.quantised(x, topk_weights, topk_ids, self.placement.expert_start)
        return kernels.fused_moe(x, self.w13, self.w2, topk_weights, topk_ids, self.placement.expert_start)

    def rebalance(self, placement: list[list[int]], reader) -> int:
        """EPLB: hold `placement` from now on: this rank's slots whose expert changed load it from the checkpoint
        (reader: stage_worker.weights.CheckpointReader). Returns the slots reloaded."""
        mine = placement[self.tp.rank]
        changed = [(i, e) for i, (e, old) in enumerate(zip(mine, self.placement.slots)) if e != old]
        w13_shards, w2_shards = _expert_shards(self.block, self.names, self.placement, changed)
        fill(self.w13.data, w13_shards, reader)
        fill(self.w2.data, w2_shards, reader)
        self.placement = dataclasses.replace(self.placement, slots=tuple(mine))
        self.stage_placement = placement
        assert self.expert_map is not None, "rebalance runs on the layers built with EPLB (they have the map)"
        self.expert_map.set(placement)
        return len(changed)

    def _forward_across_replicas(self, x: torch.Tensor, meta) -> torch.Tensor:
        """Every member's tokens through this member's experts, summed over the members (a member
        without a step of its own comes with no rows: meta is None)."""
        counted = []

        def experts(everyone: torch.Tensor) -> torch.Tensor:
            weights, ids = self._route(everyone)
            counted.append(ids)
            return self._experts(everyone, weights, ids)

        out, first = self.ep.moe(x, experts)
        if meta is None or not x.shape[0]:
            return out
        if self.expert_tokens is not None and counted:  # this member's own tokens only
            self._count(self.expert_tokens, counted[0][first:first + x.shape[0]], meta.slot_mapping)
        return self._add_shared(out, x)  # the shared expert: whole on every member (TP=1): its own tokens only

    def _count(self, counts: torch.Tensor, topk_ids: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        # a few small ops and no host sync (CUDA graphs); padding rows of a graph's batch have slot -1 (a
        # context-parallel step has its slots in meta.cp, none here: every row is real)
        real = (slot_mapping >= 0) if slot_mapping.numel() else topk_ids.new_ones(topk_ids.shape[0], dtype=torch.bool)
        real = real.to(torch.int64).repeat_interleave(self.top_k)
        counts.index_add_(0, topk_ids.reshape(-1), real)


def expert_load(model: nn.Module) -> dict[int, list[int]]:
    """Tokens routed to each expert so far, per sparse layer of the model (TP rank 0's counts)."""
    return {m.layer: m.expert_tokens.tolist() for m in model.modules()
            if isinstance(m, SparseMoeBlock) and m.expert_tokens is not None}


@contextmanager
def uncounted(model: nn.Module) -> Iterator[None]:
    """The experts' token counts left as they were (a warm-up step counts no load: StepBatch.warmup); restored
    after the step rather than skipped in it, so that a replayed CUDA graph's counting is undone too."""
    counts = [m.expert_tokens for m in model.modules() if isinstance(m, SparseMoeBlock)]
    saved = [(c, c.clone()) for c in counts if c is not None]
    try:
        yield
    finally:
        for live, before in saved:
            live.copy_(before)
