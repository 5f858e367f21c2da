"""The import graph of the project's packages, read from the source (every import, also those inside
functions): the layers have no cycle, the base imports no service, the kernels stand alone, and generated
protobuf code is imported only where a message crosses a process."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).parents[1]
PACKAGES = ("stagemesh", "scheduler", "stage_worker", "router", "kernels")
# The wire edge: the only modules that may import generated protobuf (stagemesh.v1.*_pb2, *_pb2_grpc). The rest
# of the code works on domain types (EngineRequest, SamplingParams, StepBatch, KVSourceInfo, ...), converted here.
WIRE_CONVERSION = {  # domain type <-> message, one pair per type
    "stagemesh.core.wire",  # SamplingParams, EngineRequest (SubmitRequest), KVSourceInfo
    "stagemesh.core.step_wire",  # StepBatch, StepResult, logprobs
    "stagemesh.core.tensor_wire",  # tensors as bytes with dtype and shape
    "stage_worker.validate",  # checks a wire message (activations) before it is decoded
}
SERVICERS = {  # decode, hand off, encode
    "stagemesh.core.health",  # grpc.health.v1 for every service
    "scheduler.service", "stage_worker.service", "router.frontend", "router.control",
    "scheduler.replies",  # the scheduler servicer's outputs and refusals as messages
}
CLIENTS = {  # the RPCs one service makes of another
    "scheduler.grpc_pipeline",  # the scheduler's client of its stages
    "scheduler.step_stream",  # (grpc_pipeline's steps over one Stage.ForwardStream per stage)
    "scheduler.kv_peers",  # a decode scheduler's client of its prefill peers' schedulers (their stages)
    "router.submit_stream", "router.replicas",  # the router's clients of the schedulers (requests; health, stats)
    "stage_worker.registration",  # the stage's registration with its scheduler
    "stage_worker.handoff",  # PushActivations between stages (grpc handoff)
    "stage_worker.follower",  # everything from rank 0 over its stdin (stage_worker.control)
    "stage_worker.kv_connector",  # KV blocks between prefill and decode stages (ReadKV, PullKV)
    "stagemesh.client",  # the client of the gRPC frontend
    "stagemesh.entry.ops.rpc",  # serve's client of its children (readiness, load, the routers' replicas)
}
# Modules past the edge that still import generated code, each with why. The list may only shrink: an entry
# that no longer imports it fails test_the_protobuf_lists_hold_only_modules_that_import_it.
NOT_YET_AT_THE_EDGE: dict[str, str] = {
    "stagemesh.entry.ray_executor": "one call to Ray's GCS (its cluster id) with Ray's own generated stubs, inside the "
                              "executor: a client of its own when a second call comes",
}
PROTOBUF_EDGES = WIRE_CONVERSION | SERVICERS | CLIENTS | set(NOT_YET_AT_THE_EDGE)

def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(keep=lambda target: target.split(".")[0] in PACKAGES) -> dict[str, set[str]]:
    """Every project module -> the project modules (or packages) it imports (or those `keep` says)."""
    found: dict[str, set[str]] = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            if "v1" in path.relative_to(ROOT).parts or path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
                continue
            name = module_name(path)
            targets = set()
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    targets |= {a.name for a in node.names}
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    targets |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
            found[name] = {t for t in targets if keep(t)}
    return found


def layer(module: str) -> str:
    """The layer a module belongs to: the base (stagemesh.core, the package root, the generated code),
    a service package, or the stagemesh entry points (command line, serve, generate, bench, plan, client)."""
    if module == "stagemesh" or module.startswith(("stagemesh.core", "stagemesh.v1", "stagemesh.__version__")):
        return "base"
    if module.startswith("stagemesh"):
        return "entry"
    return module.split(".")[0]


def test_the_layers_have_no_cycle():
    edges: dict[str, set[str]] = {}
    why: dict[tuple[str, str], str] = {}
    for module, targets in imports().items():
        for target in targets:
            a, b = layer(module), layer(target)
            if a != b:
                edges.setdefault(a, set()).add(b)
                why.setdefault((a, b), f"{module} imports {target}")
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                cycle = path[path.index(nxt):] + [node, nxt] if nxt in path else [node, nxt]
                steps = [why[(x, y)] for x, y in zip(cycle, cycle[1:]) if (x, y) in why]
                raise AssertionError(f"import cycle {' -> '.join(cycle)}: " + "; ".join(steps))
            if state.get(nxt) is None:
                visit(nxt, path + [node])
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node, [])


def test_the_base_imports_no_service_and_the_kernels_stand_alone():
    wrong = []
    for module, targets in imports().items():
        for target in targets:
            if layer(module) == "base" and layer(target) != "base":
                wrong.append(f"{module} imports {target}")
            # the kernels may raise the project's error type; nothing else above them
            if layer(module) == "kernels" and layer(target) != "kernels" and \
                    not target.startswith("stagemesh.core.errors"):
                wrong.append(f"{module} imports {target}")
    assert not wrong, wrong


def test_the_services_do_not_import_each_other():
    """A service package imports the base (and the kernels, for the stage) only: the scheduler drives stages
    over its Pipeline protocol, the router its replicas over gRPC. What puts them in one process (LocalEngine,
    InProcessPipeline) lives with the entry points."""
    services = {"router", "scheduler", "stage_worker"}
    wrong = sorted(f"{module} imports {target}" for module, targets in imports().items() for target in targets
                   if layer(module) in services and layer(target) in services and layer(target) != layer(module))
    assert not wrong, wrong


def imports_protobuf(target: str) -> bool:
    """Generated code: the project's (stagemesh.v1) or a library's (grpc.health.v1's health_pb2, ...)."""
    return target.startswith("stagemesh.v1") or target.endswith(("_pb2", "_pb2_grpc"))


def test_protobuf_stays_at_the_edges():
    wrong = sorted(f"{module} imports {target}" for module, targets in imports(imports_protobuf).items()
                   for target in targets if module not in PROTOBUF_EDGES)
    assert not wrong, f"generated protobuf past the wire edge (convert to a domain type there): {wrong}"


def test_the_protobuf_lists_hold_only_modules_that_import_it():
    """Every module the lists name exists and imports generated code, so the lists say what is, and the
    not-yet list can only shrink."""
    found = imports(imports_protobuf)
    stale = sorted(m for m in PROTOBUF_EDGES if not any(imports_protobuf(t) for t in found.get(m, ())))
    assert not stale, f"listed as meeting protobuf, but they do not import it (take them off): {stale}"


def test_the_router_and_the_client_import_without_torch():
    """Moving tensors is the stages' job: the router's and the client's modules load no torch (seconds and
    hundreds of MB). (A running router still loads it through transformers' AutoTokenizer.)"""
    import subprocess
    import sys

    code = "import sys, router.app, router.cli, router.frontend, stagemesh.client; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False", "torch was imported"
