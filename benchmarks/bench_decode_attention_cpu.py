"""The attention kernel by family (kernels/csrc/decode_attention_*.cpp) against the portable loop,
on a batch of decode rows like the standard workload's at its widest: --rows sequences with contexts of
16-256 prompt tokens plus 0-128 generated, the default model's heads (9 query, 3 KV, head_dim 64),
scattered blocks of 16. Prints microseconds per call (one layer), the same for the model's 30 layers,
and the ratio to the portable loop, per dtype; families this CPU cannot run are skipped by name. Then
prefill: --prefills sequences of --prefill-len tokens, every query row one row of this CPU's family kernel
(kernels/cpu_ops.paged_attention) against torch's attention one sequence at a time (the path where no
family covers the head_dim). Arms alternate for --rounds rounds and the medians are compared.

--model: instead, the default model in bf16 in-process on the standard batch (32 requests at once, prompts
16-256, outputs 16-128, as benchmarks/bench_bf16_cpu.py), one engine, its attention pinned to each family
in turn (kernels.cpu_ops.pin_attention_family; "portable" is the path before the families: the portable
decode loop and torch's attention for prefill chunks): output tokens per second, per family.

--lse: instead, the cost of the log-sum-exp context parallelism asks for (kernels/csrc/decode_attention_impl.h):
this CPU's family kernel without it (decode_attention, the serving path) and with it (decode_attention_lse), on
the decode batch and on one long row (the split-per-thread path), arms alternating; then the merge of two
partials of the decode batch, C++ (kernels/csrc/attention_merge.cpp) against the torch reference. --baseline
SO: instead, the decode_attention of a build from before the lse (the stagemesh cache keeps one per source
version; two builds cannot share a process), to compare "without the lse" with the kernel as it was: run
both, in turn. Figures are the best round (the least disturbed by other processes) and the median.

    .venv/bin/python benchmarks/bench_decode_attention_cpu.py [--rows 32] [--threads N] [--rounds 5] [--model]
    .venv/bin/python benchmarks/bench_decode_attention_cpu.py --lse [--baseline SO] [--rows 32] [--threads N]
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

import torch


def case(rows: int, dtype: torch.dtype, heads=9, kv_heads=3, dim=64, bs=16, seed=0):
    rng = random.Random(seed)
    lens = [rng.randint(16, 256) + rng.randint(0, 128) for _ in range(rows)]
    per_seq = [(n + bs - 1) // bs for n in lens]
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randperm(sum(per_seq), generator=g)
    tables = torch.zeros(rows, max(per_seq), dtype=torch.int32)
    at = 0
    for r, n in enumerate(per_seq):
        tables[r, :n] = blocks[at:at + n]
        at += n
    k = torch.randn(sum(per_seq), bs, kv_heads, dim, generator=g).to(dtype)
    v = torch.randn(sum(per_seq), bs, kv_heads, dim, generator=g).to(dtype)
    q = torch.randn(rows, heads, dim, generator=g).to(dtype)
    return (q, k, v, tables, torch.arange(rows, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32),
            dim ** -0.5), sum(lens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=100, help="calls per round")
    parser.add_argument("--prefills", type=int, default=16)
    parser.add_argument("--prefill-len", type=int, default=128)
    parser.add_argument("--model", action="store_true", help="the default model's standard batch per family")
    parser.add_argument("--lse", action="store_true", help="the family kernel with and without the lse; the merge")
    parser.add_argument("--baseline", help="--lse: the .so of a build from before the lse, timed beside")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.model:
        return model(args)
    if args.lse:
        return lse_cost(args)
    from kernels import cpu_ops, isa

    ops = cpu_ops.load()
    if ops is None:
        raise SystemExit("the CPU kernels could not be built here")
    families = ["portable", "avx2"] + (["avx512"] if ops.attention_avx512_available() else [])
    print(isa.describe(isa.cpu_flags()))
    print(f"{args.rows} decode rows, 9 heads / 3 KV heads of 64, {args.threads} threads, {args.rounds} rounds "
          f"(medians); families run here: {', '.join(families)}")
    for dtype in (torch.bfloat16, torch.float32):
        call, positions = case(args.rows, dtype)
        want = ops.decode_attention(*call, "portable").float()
        times: dict[str, list[float]] = {f: [] for f in families}
        for f in families:  # the same answer, within a bf16 step (the kernels weigh bf16 values in bf16)
            torch.testing.assert_close(ops.decode_attention(*call, f).float(), want, atol=4e-3, rtol=1e-2)
        for _ in range(args.rounds):
            for f in families:
                start = time.perf_counter()
                for _ in range(args.calls):
                    ops.decode_attention(*call, f)
                times[f].append((time.perf_counter() - start) / args.calls)
        base = statistics.median(times["portable"])
        for f in families:
            t = statistics.median(times[f])
            print(f"{str(dtype).removeprefix('torch.'):9s} {f:9s}: {t * 1e6:7.0f} us per layer, {t * 30e3:5.1f} ms for "
                  f"30 layers, {positions * 9 * 64 * 4 / t / 1e9:5.1f} GFLOPS, {base / t:4.2f}x the portable loop")

    prefill(args, cpu_ops)


def alternate(arms: dict, rounds: int, calls: int) -> dict[str, tuple[float, float]]:
    """(best, median) seconds per call of each arm, the arms run in turn for `rounds` rounds of `calls` calls."""
    times: dict[str, list[float]] = {a: [] for a in arms}
    for _ in range(rounds):
        for arm, f in arms.items():
            start = time.perf_counter()
            for _ in range(calls):
                f()
            times[arm].append((time.perf_counter() - start) / calls)
    return {a: (min(t), statistics.median(t)) for a, t in times.items()}


def lse_cost(args) -> None:
    from pathlib import Path

    from kernels import cpu_ops, isa, reference

    ops = cpu_ops._import(Path(args.baseline).stem, Path(args.baseline)) if args.baseline else cpu_ops.load()
    if ops is None:
        raise SystemExit("the CPU kernels could not be built here")
    family = isa.family_for("attention", isa.cpu_flags(), ops.attention_avx512_available())  # of this module
    print(isa.describe(isa.cpu_flags()))
    print(f"family {family}, 9 heads / 3 KV heads of 64, {args.threads} threads, {args.rounds} rounds of "
          f"{args.calls} calls: best round / median, us per call")
    for dtype in (torch.bfloat16, torch.float32):
        name = str(dtype).removeprefix("torch.")
        for label, (call, _) in ((f"{args.rows} decode rows", case(args.rows, dtype)),
                                 ("1 row of 4096 positions", long_row(dtype))):
            arms = {"before the lse": lambda: ops.decode_attention(*call, family)}
            if not args.baseline:
                out, _ = ops.decode_attention_lse(*call, family)
                assert torch.equal(out, ops.decode_attention(*call, family)), "the lse changed the output"
                arms = {"without lse": lambda: ops.decode_attention(*call, family),
                        "with lse": lambda: ops.decode_attention_lse(*call, family)}
            t = alternate(arms, args.rounds, args.calls)
            print(f"{name:9s} {label:24s}: {figures(t)}")
        if args.baseline:
            continue
        parts = torch.randn(2, args.rows, 9, 64).to(dtype)
        lses = torch.randn(2, args.rows, 9)
        t = alternate({"C++": lambda: cpu_ops.merge_attention_states(parts, lses),
                       "torch reference": lambda: reference.merge_attention_states(parts, lses)},
                      args.rounds, args.calls)
        print(f"{name:9s} merge of 2 x {args.rows} rows x 9 heads x 64: {figures(t)}")


def figures(times: dict[str, tuple[float, float]]) -> str:
    return ", ".join(f"{arm} {best * 1e6:.1f} / {median * 1e6:.1f}" for arm, (best, median) in times.items())


def long_row(dtype: torch.dtype, length: int = 4096, bs: int = 16):
    g = torch.Generator().manual_seed(1)
    blocks = length // bs
    k = torch.randn(blocks, bs, 3, 64, generator=g).to(dtype)
    v = torch.randn(blocks, bs, 3, 64, generator=g).to(dtype)
    table = torch.randperm(blocks, generator=g).to(torch.int32)[None]
    q = torch.randn(1, 9, 64, generator=g).to(dtype)
    return (q, k, v, table, torch.zeros(1, dtype=torch.int32), torch.tensor([length], dtype=torch.int32), 0.125), length


def prefill(args, cpu_ops) -> None:
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
    from kernel_cases import paged_case

    from kernels import reference

    n, length = args.prefills, args.prefill_len
    for dtype in (torch.bfloat16, torch.float32):
        call = (*paged_case([length] * n, [length] * n, 9, 3, 64, dtype=dtype), 0.125)
        arms = {"family kernel": lambda: cpu_ops.paged_attention(*call),
                "torch attention": lambda: reference.paged_attention(*call, decode=cpu_ops._decode)}
        times: dict[str, list[float]] = {a: [] for a in arms}
        for _ in range(args.rounds):
            for arm, f in arms.items():
                start = time.perf_counter()
                for _ in range(10):
                    f()
                times[arm].append((time.perf_counter() - start) / 10)
        kernel, torch_time = (statistics.median(times[a]) for a in arms)
        name = str(dtype).removeprefix("torch.")
        print(f"prefill {n} x {length} {name:9s}: family kernel ({cpu_ops.attention_family()}) "
              f"{kernel * 1e3:.2f} ms per layer, torch's attention {torch_time * 1e3:.2f} ms: "
              f"{torch_time / kernel:.2f}x")


def model(args) -> None:
    from stagemesh.core.default_model import default_model_dir
    from stagemesh.core.sampling_params import SamplingParams
    from stagemesh.entry.local_engine import LocalEngine

    from kernels import cpu_ops

    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(rng.randint(16, 256))] for _ in range(32)]
    outputs = [rng.randint(16, 128) for _ in range(32)]
    families = ["portable", cpu_ops.attention_family()]
    engine = LocalEngine.of(default_model_dir(), dtype="bfloat16", enable_prefix_caching=False)
    try:
        engine.generate(prompts[:4], [SamplingParams(max_tokens=4, ignore_eos=True)] * 4)  # warm-up
        figures: dict[str, list[float]] = {f: [] for f in families}
        for r in range(args.rounds):
            for family in families if r % 2 == 0 else families[::-1]:
                cpu_ops.pin_attention_family(family)
                start = time.perf_counter()
                engine.generate(prompts, [SamplingParams(max_tokens=n, ignore_eos=True) for n in outputs])
                figures[family].append(sum(outputs) / (time.perf_counter() - start))
    finally:
        cpu_ops.pin_attention_family(None)
        engine.close()
    print(f"default model, bf16, in-process, 32 requests at once, {args.threads} threads, {args.rounds} rounds")
    for family, runs in figures.items():
        print(f"attention {family:9s}: {statistics.median(runs):6.1f} tok/s [{', '.join(f'{x:.1f}' for x in runs)}]")
    a, b = (statistics.median(figures[f]) for f in families)
    print(f"{families[1]} / portable: {b / a:.2f}x")


if __name__ == "__main__":
    main()
