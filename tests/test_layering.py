"""The import graph of the project's packages, read from the source (every import: at module level, under
TYPE_CHECKING and inside functions): no two modules import each other, even through others; the layers have no
cycle; the floor (stagemesh.core, the package root, the client) imports neither the roof (stagemesh.entry: the
command line, serve, plan, ...) nor a service, and no service imports the roof; the kernels stand alone; generated
protobuf code is imported only where a message crosses a process. And no function takes more than 10 parameters."""
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


FLOOR = ("stagemesh.core", "stagemesh.v1", "stagemesh.client")  # with the package root, stagemesh itself
ROOF = ("stagemesh.entry", "stagemesh.__main__")  # `python -m stagemesh` is the command line


def layer(module: str) -> str:
    """The layer a module belongs to: the floor ("base": stagemesh.core, the package root, the generated code, the
    client users import), a service package, or the roof ("entry": stagemesh.entry, the entry points: command
    line, serve, generate, bench, plan, ops)."""
    if module == "stagemesh" or module.startswith(FLOOR) or module == "stagemesh.__version__":
        return "base"
    if module.startswith(ROOF):
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


# -- every import, module to module, with its line ---------------------------------------------------------------

def project_modules() -> dict[str, Path]:
    """Every project module (generated code aside) -> its file."""
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            if "v1" not in path.relative_to(ROOT).parts and not path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
                found[module_name(path)] = path
    return found


def import_lines() -> dict[str, list[tuple[str, str]]]:
    """Every project module -> (the project module it imports, "path:line: the import") for each import, wherever
    it stands (module level, under TYPE_CHECKING, inside a function). A name is read as Python binds it:
    `from kernels import cpu_ops` imports the module kernels.cpu_ops, `from kernels import rms_norm` the package
    kernels (its __init__), `import a.b.c` the module a.b.c (or the package above it that exists)."""
    modules = project_modules()

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    found: dict[str, list[tuple[str, str]]] = {}
    for module, path in modules.items():
        source = path.read_text()
        lines = source.splitlines()
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        edges = found.setdefault(module, [])
        for node in ast.walk(ast.parse(source, str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the package `level - 1` above this module's
                    above = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                    base = ".".join(above + ([base] if base else []))
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            else:
                continue
            where = f"{path.relative_to(ROOT)}:{node.lineno}: {lines[node.lineno - 1].strip()}"
            for target in {resolve(n) for n in names} - {None, module}:
                edges.append((target, where))
    return found


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(node: str) -> None:  # recursive: the graph is a few hundred modules deep at most
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_two_modules_import_each_other_even_through_others():
    """No import circle between modules, counting every import (module level, TYPE_CHECKING, inside functions:
    a circle hidden in a function is still a circle). Break one by the dependency it really has: a protocol in
    the lower module, or a registry the upper one fills. (A package whose __init__ re-exports its submodules, as
    kernels does dispatch's functions, is no circle with them while they import each other, not the package.)"""
    edges = import_lines()
    graph = {module: {target for target, _ in targets} for module, targets in edges.items()}
    report = []
    for circle in circles(graph):
        members = set(circle)
        lines = sorted({where for module in circle for target, where in edges[module] if target in members})
        report.append(f"circle {' <-> '.join(circle)}:\n    " + "\n    ".join(lines))
    assert not report, "import circles between modules:\n" + "\n".join(report)


def test_circles_are_found_wherever_the_import_stands():
    """The circle finder sees a circle of three and one through a function's import; it reads no circle into a
    chain or a package that imports its own submodules."""
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": {"c"}, "c": set()}) == []
    found = import_lines()
    # router.cli checks --responses-store inside a function: the import counts
    assert any(target == "router.responses_api.store_flags" for target, _ in found["router.cli"]), found["router.cli"]
    # `from kernels import cpu_ops` is kernels.cpu_ops's, not the package's (whose __init__ re-exports dispatch)
    assert "kernels.cpu_ops" in {t for t, _ in found["kernels.dispatch"]} and \
        "kernels" not in {t for t, _ in found["kernels.dispatch"]}


# -- the floor, the services, the roof ---------------------------------------------------------------------------

def test_the_floor_imports_neither_roof_nor_services_and_no_service_the_roof():
    """stagemesh.core, the package root and the client stand on nothing of the project above them; the roof
    (stagemesh.entry) may import every service; no service imports the roof (what puts them in one process,
    LocalEngine and InProcessPipeline, is the roof's)."""
    services = {"router", "scheduler", "stage_worker", "kernels"}
    wrong = []
    for module, targets in import_lines().items():
        for target, where in targets:
            below, above = layer(module), layer(target)
            if below == "base" and above != "base" or below in services and above == "entry":
                wrong.append(f"{module} ({below}) imports {target} ({above}): {where}")
    assert not wrong, "\n".join(sorted(wrong))


def test_the_stagemesh_package_holds_the_floor_and_one_roof():
    """stagemesh's top level is the floor's (the package root, the client) and two rooms, core/ and entry/: a new
    module goes into the room it belongs to, so that floor and roof do not mix again."""
    top = sorted(p.name for p in (ROOT / "stagemesh").iterdir()
                 if p.name != "__pycache__" and (p.suffix == ".py" or (p / "__init__.py").exists()))
    assert top == ["__init__.py", "__main__.py", "client.py", "core", "entry"], top
    assert all(layer(m) in ("base", "entry") for m in project_modules() if m.startswith("stagemesh"))


# -- parameters --------------------------------------------------------------------------------------------------

MAX_PARAMETERS = 10


def is_triton_kernel(node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """@triton.jit (or @triton.jit(...), under @triton.autotune too): a kernel's parameters are its ABI, one per
    pointer, stride and constexpr the launch passes; they cannot be gathered into an object."""
    for decorator in node.decorator_list:
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and \
                target.value.id == "triton" and target.attr == "jit":
            return True
    return False


def parameters(node: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    """The parameters a caller passes: every named one, *args and **kwargs one each, a method's self or cls not."""
    a = node.args
    names = [p.arg for p in a.posonlyargs + a.args] + ([f"*{a.vararg.arg}"] if a.vararg else [])
    names += [p.arg for p in a.kwonlyargs] + ([f"**{a.kwarg.arg}"] if a.kwarg else [])
    return names[1:] if names[:1] in (["self"], ["cls"], ["mcs"]) else names


def test_no_function_takes_more_than_ten_parameters():
    """Past 10 parameters a function wants an object that travels whole (a settings object, a request): its
    callers then pass one thing, and a setting added later touches its declaration and its use only."""
    wrong = []
    for path in project_modules().values():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not is_triton_kernel(node):
                names = parameters(node)
                if len(names) > MAX_PARAMETERS:
                    wrong.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {len(names)} parameters")
    assert not wrong, f"over {MAX_PARAMETERS} parameters:\n" + "\n".join(sorted(wrong))


def test_the_parameter_count_leaves_out_self_and_only_triton_kernels_are_exempt():
    tree = ast.parse("class C:\n    def m(self, a, *b, c, **d): ...\n"
                     "@triton.jit\ndef k(a): ...\n@triton.jit(do_not_specialize=['a'])\ndef j(a): ...\n"
                     "@torch.jit.script\ndef s(a): ...\n")
    functions = {n.name: n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
    assert parameters(functions["m"]) == ["a", "*b", "c", "**d"]
    assert [name for name, n in functions.items() if is_triton_kernel(n)] == ["k", "j"]
