"""Whether a Ray cluster has room for stages: each stage is one bundle (its TP ranks' CPUs and GPUs) that must fit
on one node. Pure: nodes' resources in, the reason there is no room (or None) out."""
from __future__ import annotations


def bundle(spec) -> dict[str, float]:
    """What a stage (a stagemesh.entry.layout.ChildSpec) asks of one node."""
    need = {"CPU": float(spec.cpus)}
    if spec.gpus:
        need["GPU"] = float(spec.gpus)
    return need


def fits(need: dict, have: dict) -> bool:
    return all(have.get(k, 0) >= v for k, v in need.items() if v)


def resources(amounts: dict) -> str:
    shown = {k: v for k, v in amounts.items() if k in ("CPU", "GPU")}
    return ", ".join(f"{k} {v:g}" for k, v in sorted(shown.items())) or "no CPU or GPU"


def missing_room(nodes: list[dict], total: dict, stages: list) -> str | None:
    """Why the nodes (each a dict of its resources) could never hold the stages, or None when they could."""
    biggest = max(nodes, key=lambda n: (n.get("GPU", 0), n.get("CPU", 0)))
    for spec in stages:
        if not any(fits(bundle(spec), n) for n in nodes):
            return (f"{spec.name} needs {resources(bundle(spec))} on one node; no node of the Ray cluster has "
                    f"that much (the largest: {resources(biggest)}). Use a smaller -tp or --threads, or add a "
                    "bigger node")
    need = {k: sum(bundle(s).get(k, 0) for s in stages) for k in ("CPU", "GPU")}
    if not fits(need, total):
        return (f"the stages need {resources(need)} in all; the Ray cluster has {resources(total)}. Add "
                "nodes, or use smaller -tp / -pp / -dp / --threads")
    return None


def missing_free_room(free: dict[str, dict], stages: list) -> str | None:
    """Why the nodes' free resources now (node address -> resources) cannot hold these stages as well as what
    runs, or None when they can (the largest stages first, each on the first node it fits)."""
    left = {node: dict(have) for node, have in free.items()}
    for spec in sorted(stages, key=lambda s: (-s.gpus, -s.cpus)):
        node = next((n for n, have in left.items() if fits(bundle(spec), have)), None)
        if node is None:
            now = "; ".join(f"node {n}: {resources({'CPU': have.get('CPU', 0), **have})}"
                            for n, have in sorted(free.items())) or "no node"
            return (f"no node of the Ray cluster has {resources(bundle(spec))} free for one of them (free now: "
                    f"{now}): add a node, or free room")
        for k, v in bundle(spec).items():
            left[node][k] = left[node].get(k, 0) - v
    return None
