"""LoRA-aware routing against round-robin (issue 46): how many adapter slot loads the router's choice avoids.

A discrete-time model of N replicas, each with --max-loras slots (LRU) and a batch of running requests, fed the
same arrival stream under each arm. The routing decision is the router's own code: router.replica_set.lora_affinity
in front of a policy of router.balancing, on replicas that show what a scheduler's stats show (running
adapters, --max-loras, load). What the model counts, per arm:
- slot loads: a request starts on a replica whose slots do not hold its adapter (the stage fills a slot from
  host memory: what LoRA-aware routing avoids);
- held back: requests that waited in a replica's queue because --max-loras other adapters ran there;
- mean load spread: max - min load over the replicas, sampled each tick (what affinity may cost in balance).

Requests arrive at --rate per tick, pick one of --adapters adapters (uniform, or Zipf with --zipf S), and run
--duration ticks once started; a replica runs at most --max-num-seqs at once. Prints each arm's figures and the
loads avoided against round-robin. (A model of the routing decision, not a timing: no model runs.)

    .venv/bin/python benchmarks/bench_lora_routing.py [--replicas 4] [--max-loras 2] [--adapters 16]
"""
from __future__ import annotations

import argparse
import random
import sys
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1]))


@dataclass
class SimReplica:
    """What the router reads of a replica (router.replicas.Replica's fields), and the replica's own state."""
    address: str
    max_loras: int
    max_num_seqs: int
    slots: OrderedDict = field(default_factory=OrderedDict)  # adapter -> None, LRU
    running: list = field(default_factory=list)  # [adapter, ticks left]
    waiting: deque = field(default_factory=deque)
    dispatched: int = 0
    healthy: bool = True
    cordoned: bool = False
    kv_role: str = "both"

    @property
    def running_adapters(self) -> frozenset[str]:
        return frozenset(a for a, _ in self.running)

    @property
    def load(self) -> int:  # router.replicas.Replica.load
        return len(self.running) + 4 * len(self.waiting) + self.dispatched

    def tick(self, duration: int, counts: dict) -> None:
        self.running = [[a, t - 1] for a, t in self.running if t > 1]
        held = deque()
        while self.waiting and len(self.running) < self.max_num_seqs:
            request = self.waiting.popleft()
            adapter = request[0]
            if adapter not in self.running_adapters and len(self.running_adapters) >= self.max_loras:
                held.append(request)  # --max-loras: it waits for a running adapter's requests to end
                if not request[1]:
                    request[1] = True
                    counts["held back"] += 1
                break
            if adapter not in self.slots:
                counts["slot loads"] += 1
                if len(self.slots) >= self.max_loras:
                    victim = next(a for a in self.slots if a not in self.running_adapters)
                    del self.slots[victim]
            self.slots[adapter] = None
            self.slots.move_to_end(adapter)
            self.running.append([adapter, duration])
        self.waiting.extendleft(reversed(held))
        self.dispatched = 0


def run_arm(arm: str, args, arrivals: list[list[str]]) -> dict:
    from router.balancing import LeastLoad, RoundRobin
    from router.replica_set import lora_affinity

    replicas = [SimReplica(f"r{i}", args.max_loras, args.max_num_seqs) for i in range(args.replicas)]
    policy = RoundRobin() if arm == "round-robin" else LeastLoad()
    counts = {"slot loads": 0, "held back": 0, "requests": 0}
    spread = []
    for tick_arrivals in arrivals:
        for adapter in tick_arrivals:
            candidates = lora_affinity(replicas, adapter) if arm == "lora-aware" else replicas
            chosen = policy.pick(candidates, [], adapter)
            chosen.waiting.append([adapter, False])
            chosen.dispatched += 1
            counts["requests"] += 1
        for r in replicas:
            r.tick(args.duration, counts)
        loads = [r.load for r in replicas]
        spread.append(max(loads) - min(loads))
    counts["mean load spread"] = round(sum(spread) / len(spread), 2)
    return counts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--max-loras", type=int, default=4)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--adapters", type=int, default=16)
    p.add_argument("--zipf", type=float, default=0.0, help="Zipf exponent of the adapters' popularity (0: uniform)")
    p.add_argument("--rate", type=float, default=4.0, help="requests per tick (Poisson)")
    p.add_argument("--duration", type=int, default=8, help="ticks a request runs")
    p.add_argument("--ticks", type=int, default=5000)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    rng = random.Random(args.seed)
    names = [f"a{i}" for i in range(args.adapters)]
    weights = [1 / (i + 1) ** args.zipf for i in range(args.adapters)]
    arrivals = []
    for _ in range(args.ticks):
        n, t = 0, rng.expovariate(args.rate)
        while t < 1:
            n, t = n + 1, t + rng.expovariate(args.rate)
        arrivals.append(rng.choices(names, weights, k=n))
    print(f"LoRA routing model: {args.replicas} replicas, --max-loras {args.max_loras}, --max-num-seqs "
          f"{args.max_num_seqs}, {args.adapters} adapters ({'Zipf ' + str(args.zipf) if args.zipf else 'uniform'}), "
          f"{args.rate} requests/tick, {args.duration} ticks each, {args.ticks} ticks")
    results = {arm: run_arm(arm, args, arrivals) for arm in ("round-robin", "least-load", "lora-aware")}
    for arm, c in results.items():
        print(f"{arm:>12}: {c['requests']} requests, {c['slot loads']} slot loads "
              f"({c['slot loads'] / c['requests']:.1%}), {c['held back']} held back, mean load spread "
              f"{c['mean load spread']}")
    rr, aware = results["round-robin"]["slot loads"], results["lora-aware"]["slot loads"]
    print(f"slot loads avoided by lora-aware against round-robin: {rr - aware} ({(rr - aware) / max(rr, 1):.0%})")


if __name__ == "__main__":
    main()
