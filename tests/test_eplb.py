"""EPLB (issue 33): the placement gives hot experts copies and evens the ranks' loads; the map sends every
token to one copy; a TP=2 expert-parallel stage that re-places its experts every few steps, moving them
between its ranks while 8 requests run, still gives transformers' greedy tokens; bad settings are refused; a
rebalance keeps the current placement unless the new one scores better on the same window by a margin."""
from __future__ import annotations

import re

import pytest
import torch

from stage_worker import eplb
from stage_worker.eplb import Balancer, EPLBConfig, ExpertMap, balancedness, plan_placement
from stagemesh.core.errors import StagemeshError


def test_the_placement_copies_hot_experts_and_evens_out_the_ranks():
    load = [900.0, 50, 40, 30, 20, 10, 10, 10]  # one expert takes most tokens
    default = [[0, 1, 2, 3], [4, 5, 6, 7]]
    plan = plan_placement(load, num_ranks=2, slots_per_rank=5)  # two redundant slots
    # a copy of the hot expert on each rank (a second on one rank would not lighten it), the spare to the next
    assert sorted(e for rank in plan for e in rank) == sorted([0, 0, 1, *range(1, 8)])
    assert all(len(rank) == 5 for rank in plan) and all(0 in rank and 1 in rank for rank in plan)
    assert balancedness(load, default) < 0.6 < 0.9 < balancedness(load, plan)
    even = plan_placement([1.0] * 8, 2, 4)
    assert sorted(map(sorted, even)) == [[0, 2, 4, 6], [1, 3, 5, 7]] and balancedness([1.0] * 8, even) == 1.0


class Layer:
    """What the balancer reads of a sparse layer (stage_worker.moe.SparseMoeBlock): its token counts and placement."""

    def __init__(self, layer: int, placement: list[list[int]]):
        self.layer, self.stage_placement, self.balancedness = layer, placement, 1.0
        self.expert_tokens = torch.zeros(8, dtype=torch.long)
        self.eplb_rebalances = {"applied": 0, "kept": 0}


def rebalance_on(layers: list[Layer], load: list[int]):
    """One rebalance of a balancer (window 4, every 4 steps) after 4 steps of this load (its window: the 3 between
    its first and last snapshots): what it returns."""
    balancer = Balancer(EPLBConfig(window_size=4, step_interval=4), layers, num_ranks=2, stage_index=0)
    plans = None
    for _ in range(4):
        for block in layers:
            block.expert_tokens += torch.tensor(load) // 4
        plans = balancer.after_step()
    return plans


def test_a_rebalance_keeps_the_placement_when_the_new_one_is_not_better(caplog):
    # the greedy packing of this window scores 0.973; the placement held (from an earlier window) scores 0.988
    load = [8, 36, 172, 132, 196, 120, 188, 152]
    current = [[6, 3, 7, 1], [2, 4, 5, 0]]
    assert balancedness(load, plan_placement(load, 2, 4)) < balancedness(load, current)
    layer = Layer(0, current)
    with caplog.at_level("INFO", logger="stagemesh.stage"):
        assert rebalance_on([layer], load) is None  # nothing moves: no pause
    assert layer.stage_placement == current and layer.eplb_rebalances == {"applied": 0, "kept": 1}
    assert "stage 0 layer 0: EPLB over the last 3 steps: balancedness 0.988 now, 0.973 with a new placement: " \
           f"the current one kept (a move needs +{eplb.MIN_BALANCEDNESS_GAIN})" in caplog.text


def test_a_rebalance_applies_a_placement_that_is_clearly_better(caplog):
    load = [200, 160, 40, 32, 24, 16, 8, 8]
    skewed, fine = Layer(0, [[0, 1, 2, 3], [4, 5, 6, 7]]), Layer(1, plan_placement(load, 2, 4))
    with caplog.at_level("INFO", logger="stagemesh.stage"):
        plans = rebalance_on([skewed, fine], load)
    assert plans is not None and balancedness(load, plans[0]) > 0.95 > 0.6 > balancedness(load, skewed.stage_placement)
    assert plans[1] == fine.stage_placement  # the layer already balanced keeps its placement (nothing reloaded)
    assert skewed.eplb_rebalances == {"applied": 1, "kept": 0} and fine.eplb_rebalances == {"applied": 0, "kept": 1}
    assert re.search(r"stage 0 layer 0: EPLB over the last 3 steps: balancedness 0\.\d+ -> 0\.\d+ with the new "
                     r"placement: applied", caplog.text)


def test_the_map_sends_each_token_to_one_copy_evenly():
    m = ExpertMap(num_experts=4, max_copies=3, device="cpu")
    m.set([[0, 1, 0], [2, 3, 0]])  # expert 0 in slots 0, 2 (rank 0) and 5 (rank 1)
    ids = torch.tensor([[0, 1]] * 6 + [[3, 2]])
    phys = m.physical(ids)
    assert phys[:6, 0].tolist() == [0, 2, 5, 0, 2, 5] and phys[:6, 1].tolist() == [1] * 6
    assert phys[6].tolist() == [4, 3]


@pytest.mark.parametrize("text, message", [
    ('{"step_interval": 0}', "must be >= 1"),
    ('{"num_redundant_experts": 1}', "split evenly over the 2"),
    ('{"windowsize": 10}', "--eplb-config takes"),
    ("[1]", "--eplb-config takes"),
    ("{oops", "is not JSON"),
])
def test_bad_eplb_settings_are_refused_by_name(text, message):
    with pytest.raises(StagemeshError, match=re.escape(message)):
        EPLBConfig.parse(text, num_experts=8, ranks=2)
    assert EPLBConfig.parse('{"num_redundant_experts": 2, "step_interval": 5}', 8, 2).num_redundant_experts == 2


@pytest.mark.slow
def test_a_stage_that_rebalances_its_experts_mid_generation_matches_transformers(tiny_model_dir, tmp_path):
    from mesh import Mesh
    from parity import prompts
    from stagemesh.core.sampling_params import SamplingParams
    from tiny_models import reference_model, reference_tokens

    model_dir = tiny_model_dir("mixtral")
    ref = reference_model(model_dir)
    batch = prompts(384, (5, 40, 17, 70, 3, 33, 9, 24))
    want = [reference_tokens(ref, p, 12) for p in batch]
    balance = ["--enable-expert-parallel", "--enable-eplb", "--eplb-config",
               '{"window_size": 4, "step_interval": 3, "num_redundant_experts": 2, "log_balancedness": true}']
    with Mesh(model_dir, [4], tp=[2], log_dir=tmp_path, stage_args=tuple(balance)) as mesh:
        got = mesh.generate(batch, SamplingParams(max_tokens=12, ignore_eos=True))
    log = (tmp_path / "stage0.log").read_text()
    assert got == want
    moves = re.findall(r"EPLB moved experts into (\d+) slot\(s\)", log)
    assert len(moves) >= 2 and any(int(n) > 0 for n in moves), log[-3000:]
    assert re.search(r"layer \d: EPLB over the last \d+ steps: balancedness [\d.]+ -> [\d.]+", log)
    assert re.search(r"EPLB balancedness over the last \d+ steps: layer 0 [\d.]+", log)  # log_balancedness


@pytest.mark.slow  # starts processes
def test_eplb_needs_experts_over_tp_ranks(tiny_model_dir):
    import subprocess
    import sys

    model = str(tiny_model_dir("mixtral"))
    base = [sys.executable, "-m", "stagemesh", "stage", model, "--scheduler", "127.0.0.1:1", "--stage-index", "0",
            "--layers", "0:4"]
    for extra, message in ((["--enable-eplb"], "needs --enable-expert-parallel"),
                           (["--eplb-config", "{}"], "--eplb-config needs --enable-eplb"),
                           (["-tp", "2", "--enable-expert-parallel", "--enable-eplb", "--eplb-config",
                             '{"num_redundant_experts": 3}'], "split evenly")):
        done = subprocess.run(base + extra, capture_output=True, text=True, timeout=120)
        assert done.returncode == 2 and message in done.stderr, done.stderr
