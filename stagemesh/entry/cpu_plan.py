"""How `stagemesh serve` shares one host's cores between its processes on CPU: threads per stage, a core kept for
the router's and the schedulers' event loops, and how long a stage's OpenMP workers spin before they sleep.

A pure function of the host's core count and the layout, so that the plan is what docs/cpu-plan.md says for any
host (tests/test_cpu_plan.py) and serve logs it at start-up. The figures behind each rule are in that doc and in
benchmarks/RESULTS.md (issue 45).
"""
from __future__ import annotations

from dataclasses import dataclass, field

# OpenMP workers of a CPU stage spin this many rounds after each parallel region before they sleep when the
# stages of a replica take turns on shared cores (PP > 1): a stage that finished its micro-batch would spin on the
# cores the next stage computes on. 20,000 still bridges the gaps between the ops of one step. Measured at batch
# 1, PP=2, 2 threads per stage on 2 cores (benchmarks/profile_mesh_step.py --threads 2): 44-45 ms per token
# against 58-64 ms with libgomp's default (300,000).
SHARED_CORES_SPIN_COUNT = "20000"
# From this many cores up, one core is left to the router's and the schedulers' event loops: the stage's threads
# then never wait at an OpenMP barrier for a thread the frontend preempted. Below it a reserved core would cost
# the model more (1/2 to 1/7 of its compute) than the frontend takes (on 2 cores at batch 1: the router and the
# scheduler together 10-15% of one core).
RESERVE_FROM_CORES = 8
# user settings that decide the spin themselves: serve leaves them alone
SPIN_VARIABLES = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")


@dataclass(frozen=True)
class CpuPlan:
    cores: int
    threads: int  # torch threads of each stage process (each TP rank)
    reserved: int  # cores left to the router and the schedulers
    env: dict[str, str] = field(default_factory=dict)  # what every CPU stage adds to its environment
    reasons: tuple[str, ...] = ()

    def describe(self) -> str:
        return (f"CPU plan on {self.cores} core(s): {self.threads} thread(s) per stage process, {self.reserved} "
                f"core(s) left to the router and schedulers, {self.spin()}; " + "; ".join(self.reasons))

    def spin(self) -> str:
        if "GOMP_SPINCOUNT" in self.env:
            return f"GOMP_SPINCOUNT={self.env['GOMP_SPINCOUNT']}"
        return "OpenMP's own spin"


def cpu_plan(cores: int, dp: int = 1, pp: int = 1, tp: int = 1, threads: int = 0,
             user_env: frozenset[str] | set[str] = frozenset()) -> CpuPlan:
    """The plan for `dp` replicas of `pp` stages of `tp` ranks on one host of `cores` cores; `threads`: the user's
    --threads (0: choose); `user_env`: the names of the environment variables the user set."""
    cores = max(1, cores)
    ranks = dp * pp * tp
    reasons = []
    reserved = 1 if cores >= RESERVE_FROM_CORES and cores - 1 >= ranks else 0
    if threads:
        reasons.append(f"--threads {threads} as given")
    else:
        threads = max(1, (cores - reserved) // ranks)
        reasons.append(f"{cores - reserved} core(s) over {ranks} stage process(es)")
    if reserved:
        reasons.append(f"one core kept for the frontend (hosts of {RESERVE_FROM_CORES}+ cores)")
    env: dict[str, str] = {}
    if set(SPIN_VARIABLES) & set(user_env):
        reasons.append("the spin is the user's (" + ", ".join(v for v in SPIN_VARIABLES if v in user_env) + ")")
    elif pp > 1 or ranks * threads > cores - reserved:
        env["GOMP_SPINCOUNT"] = SHARED_CORES_SPIN_COUNT
        reasons.append("short spin: stages take turns on shared cores" if pp > 1
                       else "short spin: the stages' threads outnumber the cores")
    else:
        reasons.append("OpenMP's own spin: no other stage waits for these cores")
    return CpuPlan(cores, threads, reserved, env, tuple(reasons))
