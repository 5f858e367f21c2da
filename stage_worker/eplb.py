"""Expert-parallel load balancing (vLLM's EPLB) for experts spread over a stage's TP ranks.

Each rank holds S expert slots, (E + R) / TP of them for E experts and R redundant copies. A sparse layer
routes each token to logical experts as always; the token then goes to one copy of each (the token's row
modulo the expert's copies: every copy gets an even share, and every rank agrees without talking), so the
fused MoE kernel and the layer's one all-reduce run as before, over physical slots. Every step_interval
steps TP rank 0 looks at the tokens each expert received over the last window_size steps, gives the hottest
experts the redundant copies and packs the copies onto the ranks so that their loads even out, and has every
rank load its slots' new experts from the checkpoint, between two steps: no request waits for more than that
pause. Balancedness is vLLM's: mean over max of the ranks' tokens. A layer keeps its placement unless the new
one scores better on the same window by MIN_BALANCEDNESS_GAIN: the packing is greedy, and can score below a
placement that already fits the load, and a move costs a pause for a gain too small to see.
"""
from __future__ import annotations

import dataclasses
import json
import logging
from collections import deque
from dataclasses import dataclass, fields

import torch

from stagemesh.core.errors import StagemeshError

log = logging.getLogger("stagemesh.stage")

# a layer's new placement is applied only when its balancedness on the window it was planned from is at least
# this much above the current placement's (absolute, balancedness being 0 to 1); otherwise the current one stays
MIN_BALANCEDNESS_GAIN = 0.01


@dataclass(frozen=True)
class EPLBConfig:
    window_size: int = 1000  # steps of expert load a rebalance looks at
    step_interval: int = 3000  # steps between two rebalances
    num_redundant_experts: int = 0  # copies of hot experts beyond one of each, over the ranks
    log_balancedness: bool = False  # log every window's balancedness (rebalances are always logged)

    @classmethod
    def parse(cls, text: str | None, num_experts: int, ranks: int) -> "EPLBConfig":
        """--eplb-config JSON (vLLM's keys); refuses unknown keys and sizes that cannot be placed."""
        try:
            given = json.loads(text) if text else {}
        except ValueError as err:
            raise StagemeshError(f"--eplb-config is not JSON: {err}") from None
        known = {f.name for f in fields(cls)}
        if not isinstance(given, dict) or set(given) - known:
            got = sorted(given) if isinstance(given, dict) else repr(given)
            raise StagemeshError(f"--eplb-config takes {sorted(known)}; got {got}")
        cfg = cls(**given)
        if min(cfg.window_size, cfg.step_interval) < 1 or cfg.num_redundant_experts < 0:
            raise StagemeshError("--eplb-config: window_size and step_interval must be >= 1, "
                                 "num_redundant_experts >= 0")
        if (num_experts + cfg.num_redundant_experts) % ranks:
            raise StagemeshError(f"--eplb-config: the {num_experts} experts and {cfg.num_redundant_experts} "
                                 f"redundant copies must split evenly over the {ranks} expert-parallel ranks")
        return cfg


def plan_placement(load: list[float], num_ranks: int, slots_per_rank: int) -> list[list[int]]:
    """Each rank's slots (logical experts), every expert at least once: the spare slots go to the experts with the
    most tokens per copy (at most one copy per rank: two on one rank share that rank's load, not lighten it), then
    the copies go heaviest first to the least loaded rank with room (another rank than the expert's other copies
    where one has room)."""
    num_experts = len(load)
    copies = [1] * num_experts
    for _ in range(num_ranks * slots_per_rank - num_experts):
        can = [e for e in range(num_experts) if copies[e] < num_ranks] or list(range(num_experts))
        hottest = max(can, key=lambda e: (load[e] / copies[e], -e))
        copies[hottest] += 1
    items = sorted(((load[e] / copies[e], e) for e in range(num_experts) for _ in range(copies[e])),
                   key=lambda x: (-x[0], x[1]))
    slots: list[list[int]] = [[] for _ in range(num_ranks)]
    rank_load = [0.0] * num_ranks
    for share, expert in items:
        free = [r for r in range(num_ranks) if len(slots[r]) < slots_per_rank]
        apart = [r for r in free if expert not in slots[r]] or free
        rank = min(apart, key=lambda r: (rank_load[r], r))
        slots[rank].append(expert)
        rank_load[rank] += share
    return slots


def balancedness(load: list[float], placement: list[list[int]]) -> float:
    """Mean over max of the ranks' tokens, each expert's tokens shared evenly by its copies (1.0: perfect)."""
    copies = [0] * len(load)
    for rank in placement:
        for e in rank:
            copies[e] += 1
    per_rank = [sum(load[e] / copies[e] for e in rank) for rank in placement]
    return (sum(per_rank) / len(per_rank)) / max(per_rank) if max(per_rank) > 0 else 1.0


class ExpertMap:
    """A layer's logical -> physical slot map, as tensors the forward reads (updated in place: CUDA graphs
    captured before a rebalance stay valid)."""

    def __init__(self, num_experts: int, max_copies: int, device):
        self.table = torch.zeros((num_experts, max_copies), dtype=torch.long, device=device)
        self.copies = torch.ones(num_experts, dtype=torch.long, device=device)

    def set(self, placement: list[list[int]]) -> None:
        slots = len(placement[0])
        table: list[list[int]] = [[] for _ in range(self.table.shape[0])]
        for rank, experts in enumerate(placement):
            for j, e in enumerate(experts):
                table[e].append(rank * slots + j)
        rows = torch.tensor([t + [t[0]] * (self.table.shape[1] - len(t)) for t in table], dtype=torch.long)
        self.table.copy_(rows)
        self.copies.copy_(torch.tensor([len(t) for t in table], dtype=torch.long))

    def physical(self, topk_ids: torch.Tensor) -> torch.Tensor:
        """Each (token, choice)'s slot: the token's row modulo its expert's copies picks the copy."""
        rows = torch.arange(topk_ids.shape[0], device=topk_ids.device).unsqueeze(1)
        return self.table[topk_ids, rows % self.copies[topk_ids]]


class Balancer:
    """TP rank 0's part: the load windows and the decision to rebalance."""

    def __init__(self, cfg: EPLBConfig, blocks: list, num_ranks: int, stage_index: int):
        self.cfg, self.blocks, self.num_ranks, self.stage_index = cfg, blocks, num_ranks, stage_index
        self.steps = 0
        self.every = max(1, cfg.window_size // 32)  # load snapshots taken this often: a window of 32 or more
        self.history: deque = deque(maxlen=cfg.window_size // self.every + 1)

    def after_step(self) -> list[list[list[int]]] | None:
        """The new placement of every layer when it is time to rebalance, else None."""
        self.steps += 1
        if self.steps % self.every == 0:
            self.history.append([b.expert_tokens.clone() for b in self.blocks])
        rebalance = self.steps % self.cfg.step_interval == 0
        report = self.cfg.log_balancedness and self.steps % self.cfg.window_size == 0
        if not (rebalance or report) or len(self.history) < 2:
            return None
        loads = [(b - a).tolist() for a, b in zip(self.history[0], self.history[-1])]
        steps = (len(self.history) - 1) * self.every
        for block, load in zip(self.blocks, loads):
            block.balancedness = balancedness(load, block.stage_placement)
        if not rebalance:
            log.info("stage %d: EPLB balancedness over the last %d steps: %s", self.stage_index, steps,
                     ", ".join(f"layer {b.layer} {b.balancedness:.3f}" for b in self.blocks))
            return None
        plans = [self._decide(block, load, steps) for block, load in zip(self.blocks, loads)]
        if all(plan is block.stage_placement for plan, block in zip(plans, self.blocks)):
            return None  # every layer keeps its placement: nothing to move, no pause
        return plans

    def _decide(self, block, load: list[float], steps: int) -> list[list[int]]:
        """The layer's new placement when it beats the current one by the margin, else its current one (the
        same object); the decision logged and counted (block.eplb_rebalances)."""
        plan = plan_placement(load, self.num_ranks, len(block.stage_placement[0]))
        now, new = block.balancedness, balancedness(load, plan)
        applied = new >= now + MIN_BALANCEDNESS_GAIN
        block.eplb_rebalances["applied" if applied else "kept"] += 1
        head = f"stage {self.stage_index} layer {block.layer}: EPLB over the last {steps} steps: balancedness"
        if applied:
            log.info("%s %.3f -> %.3f with the new placement: applied", head, now, new)
            return plan
        log.info("%s %.3f now, %.3f with a new placement: the current one kept (a move needs +%s)", head, now, new,
                 MIN_BALANCEDNESS_GAIN)
        return block.stage_placement


def balanced_blocks(model) -> list:
    """The sparse layers whose experts EPLB places (stage_worker.moe.SparseMoeBlock with a map), in order."""
    return [m for m in model.modules() if getattr(m, "expert_map", None) is not None]


def apply(runner, plans: list[list[list[int]]]) -> int:
    """Every sparse layer of this rank takes its new placement (its changed slots read from the checkpoint);
    the slots reloaded."""
    from stage_worker.weights import CheckpointReader

    reader = CheckpointReader(runner.model_dir)
    try:
        return sum(block.rebalance(plan, reader) for block, plan in zip(balanced_blocks(runner.model), plans))
    finally:
        reader.close()


def config_argv(cfg: EPLBConfig | None) -> list[str]:
    """The follower's flag for it (stage_worker.follower)."""
    return [] if cfg is None else ["--eplb-config", json.dumps(dataclasses.asdict(cfg))]


def encode(plans: list[list[list[int]]]) -> bytes:
    return torch.tensor(plans, dtype=torch.int64).numpy().tobytes()


def decode(payload: bytes, num_layers: int, num_ranks: int) -> list[list[list[int]]]:
    values = torch.frombuffer(bytearray(payload), dtype=torch.int64)
    return values.view(num_layers, num_ranks, -1).tolist()
