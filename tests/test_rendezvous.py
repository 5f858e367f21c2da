"""The scheduler refuses stages that do not fit the pipeline, with the reason."""
from __future__ import annotations


import pytest

from mesh import Mesh, run_stagemesh
from scheduler.rendezvous import ModelIdentity, Rendezvous, StageInfo
from stagemesh.core.errors import StagemeshError

MODEL = ModelIdentity("llama", 8, 64, 384, 4, 2)


def stage(index, start, end, model=MODEL, block_size=16, handoff="nccl", port=1000):
    return StageInfo(index, start, end, 1, "cpu", 100, block_size, model, f"127.0.0.1:{port + index}", handoff)


def rendezvous(pp=3) -> Rendezvous:
    return Rendezvous(pp, 16, MODEL)


def test_stages_that_tile_the_model_form_a_plan():
    r = rendezvous()
    assert r.register(stage(0, 0, 3)) == 2
    assert r.register(stage(2, 6, 8)) == 1
    assert r.register(stage(1, 3, 6)) == 0 and r.complete
    plan = r.plan()
    assert plan.rank_offsets == [0, 1, 2] and plan.world_size == 3 and plan.num_kv_blocks == 100


@pytest.mark.parametrize("stages,bad,message", [
    ([stage(0, 0, 4)], stage(1, 3, 6), r"stage 1 \(layers 3:6, at 127.0.0.1:1001\) overlaps stage 0 \(layers 0:4\)"),
    ([stage(0, 0, 3)], stage(1, 4, 6), r"leaves a gap after stage 0, which ends at layer 3"),
    ([stage(2, 6, 8)], stage(1, 3, 5), r"leaves a gap before stage 2, which starts at layer 6"),
    ([], stage(0, 0, 3, model=ModelIdentity("qwen2", 8, 64, 384, 4, 2)), r"serves another model \(qwen2"),
    ([], stage(0, 0, 3, block_size=32), r"uses --block-size 32; the scheduler uses 16"),
    ([stage(0, 0, 3)], stage(1, 3, 6, handoff="grpc"), r"uses --handoff grpc; the other stages use nccl"),
    ([], stage(3, 6, 8), r"stage index out of range for --pipeline-parallel-size 3"),
    ([], stage(0, 1, 3), r"the first stage must start at layer 0"),
    ([], stage(2, 6, 7), r"the last stage must end at layer 8"),
])
def test_refusals_name_the_reason(stages, bad, message):
    r = rendezvous()
    for s in stages:
        r.register(s)
    with pytest.raises(StagemeshError, match=message):
        r.register(bad)
    assert bad.stage_index not in r.stages or r.stages[bad.stage_index] != bad


@pytest.mark.slow
def test_refused_stage_process_exits_with_the_schedulers_reason(tiny_model_dir, tmp_path):
    model_dir = tiny_model_dir("llama")
    with Mesh(model_dir, [2, 2], log_dir=tmp_path) as mesh:
        result = run_stagemesh(["stage", str(model_dir), "--scheduler",
                                 mesh.address, "--stage-index", "1", "--layers", "1:4", "--threads", "1"], timeout=120)
    assert result.returncode == 2
    assert "stagemesh stage: error: the scheduler refused this stage: stage 1 (layers 1:4" in result.stderr
    assert "overlaps stage 0 (layers 0:2)" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize("args,message", [
    (["--layers", "2:9"], "layer range 2:9 is outside the model's 4 layers"),
    (["--layers", "0-2"], "--layers '0-2' must be A:B"),
    (["--layers", "0:2", "--tensor-parallel-size", "3"], "--tensor-parallel-size 3 does not divide the model's 4"),
])
def test_stage_flags_are_checked_before_loading(tiny_model_dir, args, message):
    result = run_stagemesh(["stage", str(tiny_model_dir("llama")), "--scheduler",
                             "127.0.0.1:1", "--stage-index", "0", *args], timeout=60)
    assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr
