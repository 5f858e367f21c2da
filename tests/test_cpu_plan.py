"""`stagemesh serve`'s CPU plan (stagemesh.entry.cpu_plan) is what docs/cpu-plan.md says, for 2-, 4- and 16-core hosts:
a pure function of the core count and the layout, no timing."""
from __future__ import annotations

import argparse

import pytest

from stagemesh.entry.cpu_plan import SHARED_CORES_SPIN_COUNT, cpu_plan


@pytest.mark.parametrize("cores, layout, threads, reserved, spin", [
    # the docs' table: one replica of one stage takes every core, with OpenMP's own spin
    (2, dict(), 2, 0, None),
    (4, dict(), 4, 0, None),
    (16, dict(), 15, 1, None),  # one core kept for the router and the schedulers
    # stages that take turns on shared cores (PP): the short spin
    (2, dict(pp=2), 1, 0, SHARED_CORES_SPIN_COUNT),
    (4, dict(pp=2), 2, 0, SHARED_CORES_SPIN_COUNT),
    (16, dict(pp=2), 7, 1, SHARED_CORES_SPIN_COUNT),
    # TP ranks and DP replicas split the cores between them
    (4, dict(tp=2), 2, 0, None),
    (16, dict(tp=2, dp=2), 3, 1, None),
    (2, dict(dp=2), 1, 0, None),
    # more stage processes than cores: one thread each, the short spin (they share the cores)
    (2, dict(dp=2, pp=2), 1, 0, SHARED_CORES_SPIN_COUNT),
    (4, dict(tp=8), 1, 0, SHARED_CORES_SPIN_COUNT),
    # 16 processes on 16 cores: no core is left to keep
    (16, dict(dp=16), 1, 0, None),
])
def test_the_plan_for_2_4_and_16_cores_is_the_documented_one(cores, layout, threads, reserved, spin):
    plan = cpu_plan(cores, **layout)
    assert (plan.threads, plan.reserved, plan.env.get("GOMP_SPINCOUNT")) == (threads, reserved, spin)
    described = plan.describe()
    assert f"{threads} thread(s) per stage process" in described
    assert (f"GOMP_SPINCOUNT={spin}" if spin else "OpenMP's own spin") in described


def test_the_users_threads_and_spin_are_kept():
    plan = cpu_plan(16, threads=4)
    assert plan.threads == 4 and "--threads 4 as given" in plan.describe()
    for variable in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY"):
        plan = cpu_plan(2, pp=2, user_env={variable, "PATH"})
        assert plan.env == {} and variable in plan.describe()


def test_serve_gives_its_stages_the_plan(monkeypatch):
    """The stages' command lines and environments (what serve starts) carry the plan for this host."""
    from stagemesh.entry import layout as layout_module
    from stagemesh.entry.layout import MeshLayout

    monkeypatch.setattr(layout_module.os, "cpu_count", lambda: 16)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)

    def stages(pp: int) -> list:
        from stagemesh.entry.serve import add_arguments

        parser = argparse.ArgumentParser()
        add_arguments(parser)
        args = parser.parse_args(["--pipeline-parallel-size", str(pp)])
        return MeshLayout.build(args, None, 30, cuda=False).replica(0)[1][1:]

    (one,) = stages(1)
    assert one.argv[one.argv.index("--threads") + 1] == "15" and "GOMP_SPINCOUNT" not in one.env
    two = stages(2)
    assert [s.argv[s.argv.index("--threads") + 1] for s in two] == ["7", "7"]
    assert all(s.env["GOMP_SPINCOUNT"] == SHARED_CORES_SPIN_COUNT for s in two)
