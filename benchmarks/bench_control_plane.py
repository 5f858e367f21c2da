"""The control plane's cost per token (issue 59): router, scheduler and stage CPU per generated token, read from
/proc (utime + stime of every process of the role, its threads and TP followers included) around each served run,
at batch 1 and at 32 concurrent streams; steps per second and the scheduler's overhead per step (its CPU per step,
and the step's wall time less the stages' reported compute); served mesh against the in-process engine
(stagemesh.entry.local_engine: the same driver and stage code in one process), side by side, alternating, in one run;
and the physical bound: the bf16 products of the decode shapes on this machine's kernels (kernels/csrc/
bf16_linear.cpp, every core), as tokens per second.

Workloads (bench_mesh_tax's): batch 1 (--bs1-requests one at a time, 32 prompt tokens, --bs1-tokens out) and
the standard one (32 requests at once, prompts 16-256, outputs 16-128, ignore_eos, seed 0). CPU time per token is
robust to load from elsewhere on a shared machine (it counts the work, not the waits); the wall-clock ratios are
not, which is why the two sides alternate within each round and the load average is printed with them.

Every process also spends CPU while nothing runs (health checks, load figures, heartbeats): measured for
--idle-seconds before the runs and printed as ms per second; the per-token figures are given as read (raw) and
less that idle rate over the run's duration (work). On a loaded machine, where a run takes long, the raw figure
is mostly the idle rate. --layers N serves the embedded model cut to its first N layers (same tokenizer and
vocabulary: the control plane's work per token is the same, the stage's is smaller, so a run measures the
control plane in seconds rather than minutes).

--vllm VENV serves the same model with vLLM-CPU from that venv (docs/benchmarks.md installs it; bf16, no prefix
caching, both cores for its worker) beside the mesh, in the same rounds with the same client: the real peer. Its
API server (HTTP, detokenising, its side of the engine's ZMQ sockets) is read as the router's role; its EngineCore
(scheduler and model in one process) has no split between the scheduler's role and the stage's, so the fair
comparison is the total CPU a token.

    .venv/bin/python benchmarks/bench_control_plane.py [--rounds 2] [--workloads batch1,standard] \
        [--serve-args "..."] [--no-inprocess] [--no-bound] [--layers N] [--vllm /tmp/vllm-venv]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from bench_mesh_tax import WORKLOADS, isa, served  # noqa: E402

# --tree DIR: the in-process engine (a subprocess of this script) from that checkout of the project
sys.path.insert(0, os.environ.get("STAGEMESH_BENCH_TREE") or str(Path(__file__).parents[1]))

ROLES = ("router", "scheduler", "stage")
CLK_TCK = os.sysconf("SC_CLK_TCK")


# -- /proc -------------------------------------------------------------------------------------------------
def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


def service_pids(root: int) -> dict[str, list[int]]:
    """The mesh's processes by role: `python -m stagemesh router|scheduler|stage ...` under serve, each with its
    own children (a stage's TP followers) counted as the stage."""
    roles: dict[str, list[int]] = {r: [] for r in ROLES}

    def walk(pid: int, role: str | None) -> None:
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            return
        if role is None and len(argv) > 3 and argv[1:3] == [b"-m", b"stagemesh"] and argv[3].decode() in ROLES:
            role = argv[3].decode()
        if role is not None:
            roles[role].append(pid)
        for child in _children(pid):
            walk(child, role)

    for child in _children(root):
        walk(child, None)
    return roles


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all its threads, live and exited)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def role_cpu(pids: dict[str, list[int]]) -> dict[str, float]:
    return {role: sum(cpu_seconds(p) for p in ps) for role, ps in pids.items()}


def load_average() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


# -- the scheduler's step counters -------------------------------------------------------------------------
def scheduler_address(pid: int) -> str:
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    return f"127.0.0.1:{argv[argv.index('--port') + 1]}"


def step_stats(address: str) -> tuple[int, float, float]:
    """(steps, their wall seconds, the stages' compute seconds) so far."""
    from stagemesh.core.service_options import channel
    from stagemesh.v1 import scheduler_pb2, scheduler_pb2_grpc

    with channel(address) as chan:
        s = scheduler_pb2_grpc.SchedulerStub(chan).GetStats(scheduler_pb2.GetStatsRequest(), timeout=10)
    return s.num_steps, s.step_seconds_total, s.stage_compute_seconds_total


def idle_rates(pids: dict[str, list[int]], seconds: float) -> dict[str, float]:
    """CPU seconds per second each role spends while no request runs."""
    before = role_cpu(pids)
    time.sleep(seconds)
    after = role_cpu(pids)
    return {r: (after[r] - before[r]) / seconds for r in ROLES}


def served_run(base: str, name: str, pids: dict[str, list[int]], scheduler: str | None,
               idle: dict[str, float]) -> dict:
    """One served run of a workload, with the CPU each role spent (raw, and less its idle rate) and the steps
    (`scheduler`: its address; None for vLLM, which has no step counters to read)."""
    steps0, cpu0 = step_stats(scheduler) if scheduler else None, role_cpu(pids)
    fig = served(base, name)
    cpu1 = role_cpu(pids)
    tokens, seconds = fig["total_output_tokens"], fig["duration_s"]
    fig.update({f"{r}_raw_ms_per_token": 1e3 * (cpu1[r] - cpu0[r]) / tokens for r in ROLES})
    fig.update({f"{r}_ms_per_token": 1e3 * (cpu1[r] - cpu0[r] - idle[r] * seconds) / tokens for r in ROLES})
    for kind in ("", "raw_"):
        fig[f"control_{kind}ms_per_token"] = fig[f"router_{kind}ms_per_token"] + fig[f"scheduler_{kind}ms_per_token"]
        fig[f"total_{kind}ms_per_token"] = fig[f"control_{kind}ms_per_token"] + fig[f"stage_{kind}ms_per_token"]
    if steps0 is None:
        return fig
    steps1 = step_stats(scheduler)
    steps = steps1[0] - steps0[0]
    fig["steps"] = steps
    fig["steps_per_s"] = steps / fig["duration_s"]
    fig["scheduler_cpu_ms_per_step"] = 1e3 * (cpu1["scheduler"] - cpu0["scheduler"] - idle["scheduler"] * seconds) \
        / steps
    fig["step_ms"] = 1e3 * (steps1[1] - steps0[1]) / steps
    fig["compute_ms"] = 1e3 * (steps1[2] - steps0[2]) / steps
    fig["overhead_ms_per_step"] = fig["step_ms"] - fig["compute_ms"]
    return fig


# -- the peer ------------------------------------------------------------------------------------------------
def start_vllm(venv: Path, model: Path, log: Path, timeout: float = 900) -> tuple[subprocess.Popen, str]:
    """vLLM-CPU serving `model` as docs/benchmarks.md starts it (bf16, no prefix caching, both cores for its
    worker, Intel OpenMP preloaded), once /v1/models answers; its log if it does not come up."""
    import requests
    from serve_process import free_port, stop

    port = free_port()
    env = {**os.environ, "LD_PRELOAD": str(venv / "lib" / "libiomp5.so"), "VLLM_TARGET_DEVICE": "cpu",
           "VLLM_CPU_OMP_THREADS_BIND": f"0-{(os.cpu_count() or 1) - 1}", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    proc = subprocess.Popen([str(venv / "bin" / "vllm"), "serve", str(model), "--port", str(port), "--dtype",
                             "bfloat16", "--kv-cache-memory-bytes", str(2 << 30), "--no-enable-prefix-caching",
                             "--served-model-name", model.name], stdout=open(log, "ab"), stderr=subprocess.STDOUT,
                            env=env, start_new_session=True)
    base, start = f"http://127.0.0.1:{port}", time.monotonic()
    print(f"waiting up to {timeout:.0f} s for vLLM at {base} (log {log})", flush=True)
    while True:
        if proc.poll() is not None or time.monotonic() - start > timeout:
            stop(proc)
            sys.exit(f"vLLM did not come up:\n{log.read_text()[-3000:]}")
        try:
            if requests.get(f"{base}/v1/models", timeout=2).status_code == 200:
                return proc, base
        except requests.RequestException:
            pass
        time.sleep(0.5)


def vllm_pids(root: int) -> dict[str, list[int]]:
    """vLLM's processes: its API server (the `vllm serve` process) as the router's role, everything under it
    (the EngineCore: scheduler and model) as the stage's."""
    engine: list[int] = []
    todo = _children(root)
    while todo:
        pid = todo.pop()
        engine.append(pid)
        todo += _children(pid)
    return {"router": [root], "scheduler": [], "stage": engine}


# -- the bound -----------------------------------------------------------------------------------------------
def bound() -> dict:
    """One decode step's linear products (every layer's qkv, o, gate_up and down, and the LM head) on the stage's
    bf16 kernels, at 1 and 32 rows, and 256 rows (a prefill chunk's): each product's best of many runs (the least
    another process's load took from it), with every core, and on one core times the cores (whichever is faster:
    a bound is what the machine can do); as tokens per second and GFLOPS."""
    import torch

    from kernels import cpu_ops
    from stagemesh.core.default_model import resolve_model

    if cpu_ops.load() is None:
        return {"error": "the CPU kernels are not built"}
    cfg = json.loads((Path(resolve_model(None)) / "config.json").read_text())
    h, inter, layers, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    q = cfg["num_attention_heads"] * cfg.get("head_dim", h // cfg["num_attention_heads"])
    kv = cfg["num_key_value_heads"] * cfg.get("head_dim", h // cfg["num_attention_heads"])
    shapes = {(q + 2 * kv, h): layers, (h, q): layers, (2 * inter, h): layers, (h, inter): layers, (vocab, h): 1}
    flops_per_token = 2 * sum(n * k * times for (n, k), times in shapes.items())
    torch.manual_seed(0)
    packed = {(n, k): cpu_ops.pack_bf16_weight(torch.randn(n, k, dtype=torch.bfloat16) * 0.02) for n, k in shapes}
    cores = os.cpu_count() or 1
    out: dict = {"family": cpu_ops.bf16_family(), "cores": cores, "flops_per_token": flops_per_token}

    def best(x, w, n: int, reps: int) -> float:
        cpu_ops.linear_bf16(x, w, n)
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            cpu_ops.linear_bf16(x, w, n)
            times.append(time.perf_counter() - start)
        return min(times)

    for rows in (1, 32, 256):
        step = {}
        for threads in sorted({cores, 1}):
            torch.set_num_threads(threads)
            seconds = 0.0
            for (n, k), times in shapes.items():
                x = torch.randn(1 if n == vocab and rows > 32 else rows, k, dtype=torch.bfloat16)  # (prefill: the
                seconds += times * best(x, packed[n, k], n, 30 if rows < 256 else 10)  # last row's logits only)
            step[threads] = seconds / (cores / threads)
        seconds = min(step.values())
        out[f"rows{rows}_ms"] = seconds * 1e3
        out[f"rows{rows}_ms_by_threads"] = {t: round(s * 1e3, 3) for t, s in step.items()}
        out[f"rows{rows}_tok_per_s"] = rows / seconds
        out[f"rows{rows}_gflops"] = rows * flops_per_token / seconds / 1e9
    return out


def standard_bound(b: dict) -> float:
    """The standard workload's output tokens per second if its products ran at the measured rates and nothing else
    took time: its prompt tokens at the 256-row rate, its output tokens at the 32-row (decode) rate."""
    from bench_mesh_tax import workload

    reqs = workload("standard")
    prompt, output = sum(r.input_len for r in reqs), sum(r.max_tokens for r in reqs)
    seconds = prompt / b["rows256_tok_per_s"] + output / b["rows32_tok_per_s"]
    return output / seconds


# -- in-process ---------------------------------------------------------------------------------------------------
def inprocess(model: Path, name: str) -> dict:
    """One in-process run (this process): the engine as serve's stage gets it (all the cores), warmed up, on the
    served run's workload (bench_mesh_tax's client loop)."""
    from bench_mesh_tax import inprocess as run

    return run("bf16", name, model)


def inprocess_run(name: str, args, model: Path, tree: Path) -> dict:
    """The in-process engine of `tree` on the same workload, in a fresh process (bf16)."""
    out = subprocess.run([sys.executable, __file__, "--inprocess", name, "--model", str(model), "--bs1-requests",
                          str(args.bs1_requests), "--bs1-tokens", str(args.bs1_tokens)], capture_output=True,
                         text=True, timeout=1200, cwd=tree, env={**os.environ, "STAGEMESH_BENCH_TREE": str(tree)})
    if out.returncode:
        sys.exit(f"in-process {name} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


# -- the model ---------------------------------------------------------------------------------------------------
def cut_model(layers: int, folder: Path) -> Path:
    """The embedded model's first `layers` layers, its tokenizer and vocabulary, in `folder`."""
    import shutil

    from safetensors.torch import load_file, save_file

    from stagemesh.core.default_model import resolve_model

    src = Path(resolve_model(None))
    folder.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.suffix in (".json", ".jinja") and f.name != "config.json":
            shutil.copy(f, folder / f.name)
    cfg = json.loads((src / "config.json").read_text())
    cfg["num_hidden_layers"] = layers
    (folder / "config.json").write_text(json.dumps(cfg))
    keep = {k: v for k, v in load_file(src / "model.safetensors").items()
            if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers}
    save_file(keep, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


# -- the run -----------------------------------------------------------------------------------------------------
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--workloads", default="batch1,standard")
    p.add_argument("--bs1-requests", type=int, default=8)
    p.add_argument("--bs1-tokens", type=int, default=128)
    p.add_argument("--layers", type=int, help="serve the embedded model cut to its first N layers")
    p.add_argument("--idle-seconds", type=float, default=10.0)
    p.add_argument("--serve-args", default="", help="more flags for serve (bf16, no prefix caching by default)")
    p.add_argument("--no-inprocess", action="store_true", help="served runs only (the CPU figures)")
    p.add_argument("--tree", type=Path, action="append", help=(
        "serve this checkout of the project (its stagemesh/v1 a link to its protos/stagemesh/v1) instead of this "
        "one; given several times, each is served and their runs alternate (a before / after in one run; the "
        "in-process engine is the first one's)"))
    p.add_argument("--no-bound", action="store_true")
    p.add_argument("--vllm", type=Path, metavar="VENV", help="also serve the model with vLLM-CPU from this venv")
    p.add_argument("--bound", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--inprocess", metavar="WORKLOAD", help=argparse.SUPPRESS)
    p.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.bound:
        print(json.dumps(bound()))
        return
    WORKLOADS["batch1"] = dict(num=args.bs1_requests, input_len=(32, 32), output_len=(args.bs1_tokens,) * 2,
                               concurrency=1)
    WORKLOADS["warm-up"] = dict(num=2, input_len=(32, 32), output_len=(16, 16), concurrency=1)
    if args.inprocess:
        print(json.dumps(inprocess(args.model, args.inprocess)))
        return
    names = args.workloads.split(",")
    trees = [t.resolve() for t in args.tree] if args.tree else [Path(__file__).parents[1]]
    print(f"machine: {isa()}; load average {load_average()}; code: {', '.join(map(str, trees))}", flush=True)
    b = None
    if not args.no_bound:
        out = subprocess.run([sys.executable, __file__, "--bound"], capture_output=True, text=True, timeout=600)
        b = json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else {"error": out.stderr[-500:]}
        print(f"bound: {b}", flush=True)
    with tempfile.TemporaryDirectory(prefix="stagemesh-control-plane-") as tmp:
        from stagemesh.core.default_model import resolve_model

        model = cut_model(args.layers, Path(tmp) / "model") if args.layers else Path(resolve_model(None))
        figures = run(args, names, model, trees, Path(tmp))
    report(names, figures, b, args, [_label(t, trees) for t in trees] + (["vllm"] if args.vllm else []))


def _label(tree: Path, trees: list[Path]) -> str:
    return "mesh" if len(trees) == 1 else f"mesh {tree.name}"


def run(args, names: list[str], model: Path, trees: list[Path], tmp: Path) -> dict:
    """Every tree served at once; per round and workload each tree's served run and the in-process engine's, in
    an order that turns every round."""
    from serve_process import start_serve, stop

    from stagemesh.core import internal_token

    os.environ[internal_token.ENV] = internal_token.new_token()  # serve's, so that GetStats may be called
    internal_token.configure(argparse.Namespace())
    figures: dict = {"idle": {}}
    servers: dict[str, tuple] = {}
    try:
        for tree in trees:  # (serve runs `python -m stagemesh` from its directory, first on its children's path)
            label = _label(tree, trees)
            proc, base = start_serve([str(model), "--no-enable-prefix-caching", "--dtype", "bfloat16",
                                      *args.serve_args.split()], log=tmp / f"serve-{tree.name}.log", cwd=tree)
            pids = service_pids(proc.pid)
            servers[label] = (proc, base, pids, scheduler_address(pids["scheduler"][0]))
            print(f"{label}: {tree} serving {model.name} at {base}: "
                  f"{', '.join(f'{r} {v}' for r, v in pids.items())}", flush=True)
        if args.vllm:
            proc, base = start_vllm(args.vllm, model, tmp / "vllm.log")
            servers["vllm"] = (proc, base, vllm_pids(proc.pid), None)
            print(f"vllm: serving {model.name} at {base}: API server {proc.pid}, engine "
                  f"{servers['vllm'][2]['stage']}", flush=True)
        for label, (_, base, pids, _) in servers.items():
            served(base, "warm-up")  # the router's and the scheduler's first requests
            idle = figures["idle"][label] = idle_rates(pids, args.idle_seconds)
            print(f"{label} idle CPU ms/s: " + " ".join(f"{r} {1e3 * v:.2f}" for r, v in idle.items()), flush=True)
        sides = [*servers, *([] if args.no_inprocess else ["in-process"])]
        for rnd in range(args.rounds):
            for i, name in enumerate(names):
                turn = (rnd + i) % len(sides)
                for side in sides[turn:] + sides[:turn]:
                    if side == "in-process":
                        fig = inprocess_run(name, args, model, trees[0])
                    else:
                        _, base, pids, scheduler = servers[side]
                        fig = served_run(base, name, pids, scheduler, figures["idle"][side])
                    figures.setdefault((name, side), []).append(fig)
                    print(f"round {rnd + 1} {name:8} {side:14} {_line(fig, side)}  (load {load_average()})",
                          flush=True)
    finally:
        for proc, *_ in servers.values():
            stop(proc)
    return figures


def _line(fig: dict, side: str) -> str:
    line = f"{fig['output_throughput']:7.1f} tok/s  TPOT {fig['mean_tpot_ms']:6.2f} ms" \
        f"  TTFT {fig['mean_ttft_ms']:7.1f} ms"
    if side != "in-process":
        line += "  CPU ms/token (raw): " + " ".join(
            f"{r} {fig[f'{r}_ms_per_token']:.3f} ({fig[f'{r}_raw_ms_per_token']:.3f})" for r in (*ROLES, "total"))
    if "steps" in fig:
        line += f"  steps/s {fig['steps_per_s']:.1f}  scheduler CPU/step {fig['scheduler_cpu_ms_per_step']:.3f} ms" \
            f"  step - compute {fig['overhead_ms_per_step']:.3f} ms"
    return line


def report(names: list[str], figures: dict, b: dict | None, args, labels: list[str]) -> None:
    def med(name: str, side: str, key: str) -> float:
        return statistics.median(f[key] for f in figures[name, side])

    print(f"\nmachine: {isa()}; load average {load_average()}; medians of {args.rounds} round(s); "
          f"{'the embedded model' if not args.layers else f'the embedded model cut to {args.layers} layers'}")
    for label in labels:
        print(f"{label} idle CPU ms/s: " + " ".join(f"{r} {1e3 * v:.2f}" for r, v in figures["idle"][label].items()))
    print("CPU per output token less the idle rate (raw in brackets)\n")
    print("| served | workload | router ms/token | scheduler ms/token | router + scheduler | stage ms/token | "
          "all ms/token | steps/s | scheduler CPU ms/step | step - compute ms | tok/s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")

    def both(name: str, side: str, key: str, digits: int = 3) -> str:
        work, raw = med(name, side, f"{key}_ms_per_token"), med(name, side, f"{key}_raw_ms_per_token")
        return f"{work:.{digits}f} ({raw:.{digits}f})"

    for label in labels:
        for name in names:
            if label == "vllm":  # (its API server in the router's column; scheduler and model are one process)
                print(f"| vLLM | {name} | {both(name, label, 'router')} (API server) | - | - | "
                      f"{both(name, label, 'stage', 2)} (EngineCore) | {both(name, label, 'total', 2)} | - | - | - | "
                      f"{med(name, label, 'output_throughput'):.1f} |")
                continue
            print(f"| {label} | {name} | {both(name, label, 'router')} | {both(name, label, 'scheduler')} | "
                  f"**{both(name, label, 'control')}** | {both(name, label, 'stage', 2)} | "
                  f"{both(name, label, 'total', 2)} | {med(name, label, 'steps_per_s'):.1f} | "
                  f"{med(name, label, 'scheduler_cpu_ms_per_step'):.3f} | "
                  f"{med(name, label, 'overhead_ms_per_step'):.3f} | "
                  f"{med(name, label, 'output_throughput'):.1f} |")
    if not args.no_inprocess:
        print("\n| served | workload | mesh tok/s | in-process tok/s | mesh / in-process | mesh TPOT ms | "
              "in-process TPOT ms |")
        print("|---|---|---|---|---|---|---|")
        for label in labels:
            for name in names:
                m, i = med(name, label, "output_throughput"), med(name, "in-process", "output_throughput")
                print(f"| {label} | {name} | {m:.1f} | {i:.1f} | **{m / i:.2f}** | "
                      f"{med(name, label, 'mean_tpot_ms'):.2f} | {med(name, 'in-process', 'mean_tpot_ms'):.2f} |")
    if b and "error" not in b:
        print(f"\nbound (bf16 products alone, {b['family']}, {b['cores']} cores): batch 1 "
              f"{b['rows1_tok_per_s']:.0f} tok/s ({b['rows1_ms']:.2f} ms a token, {b['rows1_gflops']:.0f} GFLOPS); "
              f"32 rows {b['rows32_tok_per_s']:.0f} tok/s ({b['rows32_gflops']:.0f} GFLOPS); 256 rows "
              f"{b['rows256_gflops']:.0f} GFLOPS; the standard workload {standard_bound(b):.0f} tok/s")
        if not args.layers:
            for label in labels:
                for name in ("batch1", "standard"):
                    if name in names:
                        limit = b["rows1_tok_per_s"] if name == "batch1" else standard_bound(b)
                        print(f"{label} {name} / bound: {med(name, label, 'output_throughput') / limit:.2f}")


if __name__ == "__main__":
    main()
