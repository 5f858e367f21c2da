"""MoE decode at batch 32 on two CPU ranks: expert parallel (EP=2) against tensor parallel (TP=2)
experts, the collectives EP could use to bring results back, and the expert-load counter after it.

A random Mixtral-shaped checkpoint is made once into the stagemesh cache (or --model DIR). Two
rank processes (gloo, with the stage's shared-memory all-reduce) each build both layouts of the
same weights, prefill --batch prompts and time --steps greedy decode steps of each, alternating
for --rounds rounds so that load from elsewhere hits both; medians are compared.

    .venv/bin/python benchmarks/bench_moe.py [--hidden 1024 --moe-intermediate 2048 --layers 4]
        [--batch 32 --steps 32 --rounds 3] [--collectives-only]
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
from datetime import timedelta
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

WORLD = 2


def moe_model_dir(args) -> Path:
    """A random Mixtral-shaped checkpoint of this shape, made once into the stagemesh cache."""
    from stagemesh.core.default_model import cache_root

    shape = f"h{args.hidden}-i{args.moe_intermediate}-e{args.experts}-k{args.top_k}-l{args.layers}"
    target = cache_root() / "bench" / f"mixtral-shape-{shape}"
    if (target / "config.json").is_file():
        return target
    from transformers import AutoModelForCausalLM, MixtralConfig

    config = MixtralConfig(hidden_size=args.hidden, intermediate_size=args.moe_intermediate,
                           num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                           num_key_value_heads=max(1, args.hidden // 256), num_local_experts=args.experts,
                           num_experts_per_tok=args.top_k, vocab_size=4096, max_position_embeddings=1024,
                           sliding_window=None, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.05)  # routers wide enough that experts are chosen unevenly, as trained ones are
    tmp = target.with_name(target.name + ".tmp")
    model.save_pretrained(tmp, safe_serialization=True)
    tmp.rename(target)
    return target


# -- one rank ----------------------------------------------------------------------------------

def median_ms(fn, iters: int) -> float:
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def time_collectives(tp, rows: int, hidden: int, iters: int) -> dict[str, float]:
    """The ways expert outputs could return to every rank, on [rows, hidden] fp32."""
    x = torch.zeros(rows, hidden)  # summed in place over and over: zeros stay finite
    half, whole = torch.empty(rows // WORLD, hidden), torch.empty(rows, hidden)

    def all_to_all_then_gather():  # each token's top-k results to its owner rank, summed, gathered back
        received = torch.empty_like(x)
        dist.all_to_all_single(received, x)
        dist.all_gather_single(whole, received.view(WORLD, rows // WORLD, hidden).sum(0))

    def reduce_scatter_then_gather():
        dist.reduce_scatter_single(half, x)
        dist.all_gather_single(whole, half)

    return {"shared-memory all-reduce (the stage's TP all-reduce)": median_ms(lambda: tp.all_reduce(x), iters),
            "gloo all-reduce": median_ms(lambda: dist.all_reduce(x), iters),
            "gloo all_to_all + all-gather": median_ms(all_to_all_then_gather, iters),
            "gloo reduce-scatter + all-gather": median_ms(reduce_scatter_then_gather, iters)}


def decode_workload(runner, prompts: list[list[int]], steps: int) -> tuple[list[float], list[list[int]]]:
    """Prefill every prompt in one step, then `steps` greedy decode steps: ms per decode step, tokens."""
    from stagemesh.core.sampling_params import SamplingParams
    from stagemesh.core.step import NewSequence, ScheduledChunk, ScheduledChunks, StepBatch

    bs, batch = runner.block_size, len(prompts)
    runner.reset(batch * -(-(len(prompts[0]) + steps + 1) // bs))
    seqs = [NewSequence(i, p, SamplingParams(max_tokens=steps + 1, ignore_eos=True)) for i, p in enumerate(prompts)]
    per_seq = runner.kv_caches[0][0].shape[0] // batch
    chunks = [ScheduledChunk(i, p, 0, list(range(i * per_seq, (i + 1) * per_seq)), True) for i, p in enumerate(prompts)]
    out = runner.execute(StepBatch(0, seqs, ScheduledChunks.of(chunks)), return_logits=True)
    tokens = [[t] for t in out.logits.argmax(-1).tolist()]  # every rank has the gathered logits
    times = []
    for step in range(1, steps + 1):
        chunks = [ScheduledChunk(i, [tokens[i][-1]], len(p) + step - 1, [], True) for i, p in enumerate(prompts)]
        start = time.perf_counter()
        out = runner.execute(StepBatch(step, [], ScheduledChunks.of(chunks)), return_logits=True)
        times.append((time.perf_counter() - start) * 1e3)
        for seq, t in zip(tokens, out.logits.argmax(-1).tolist()):
            seq.append(t)
    runner.execute(StepBatch(steps + 1, [], finished_seq_ids=list(range(batch))))
    return times, tokens


def compare_layouts(args, store) -> dict:
    """Decode with the experts TP-sharded and expert-parallel, alternating; medians, tokens, expert load."""
    from stage_worker.dist import attach_shm
    from stage_worker.moe import expert_load
    from stage_worker.runner import StageRunner

    runners = {}
    for name, ep in (("TP=2", False), ("EP=2", True)):
        runner = StageRunner.of(args.model, 0, args.layers, tp_rank=args.rank, tensor_parallel_size=WORLD,
                                tp_group=dist.group.WORLD, enable_expert_parallel=ep)
        runner.tp.shm = attach_shm(store, f"bench-{name}", runner.tp)  # as stage_worker.dist does per epoch
        runners[name] = runner
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(3, 4096, (args.batch, args.prompt_len), generator=g).tolist()
    times, tokens = {name: [] for name in runners}, {}
    for _ in range(args.rounds):
        for name, runner in runners.items():
            step_ms, tokens[name] = decode_workload(runner, prompts, args.steps)
            times[name] += step_ms
    return {"decode_ms": {name: statistics.median(t) for name, t in times.items()}, "tokens": tokens,
            "expert_load": expert_load(runners["EP=2"].model)}


def rank_main(args) -> None:
    from stage_worker.dist import attach_shm
    from stage_worker.parallel import TPGroup

    torch.set_num_threads(args.threads)
    store = dist.TCPStore("127.0.0.1", args.port, WORLD, args.rank == 0, timeout=timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=args.rank, world_size=WORLD)
    tp = TPGroup(args.rank, WORLD, dist.group.WORLD)
    tp.shm = attach_shm(store, "bench-collectives", tp)
    result = {"collectives_ms": time_collectives(tp, args.batch, args.hidden, args.collective_iters)}
    if not args.collectives_only:
        result.update(compare_layouts(args, store))
    if args.rank == 0:
        Path(args.out).write_text(json.dumps(result))
    dist.destroy_process_group()


# -- the parent ----------------------------------------------------------------------------------

def report(args, result: dict) -> None:
    print(f"collectives on [{args.batch}, {args.hidden}] fp32, {WORLD} ranks, median of {args.collective_iters}:")
    for name, ms in result["collectives_ms"].items():
        print(f"  {name:<52}{ms:8.3f} ms")
    if args.collectives_only:
        return
    tp, ep = result["decode_ms"]["TP=2"], result["decode_ms"]["EP=2"]
    same = sum(a == b for a, b in zip(result["tokens"]["TP=2"], result["tokens"]["EP=2"]))
    print(f"\nMoE decode at batch {args.batch} ({args.layers} layers, hidden {args.hidden}, {args.experts} experts "
          f"of {args.moe_intermediate}, top-{args.top_k}), median ms per step over {args.rounds} round(s):")
    print(f"  TP=2 experts {tp:8.2f} ms   EP=2 experts {ep:8.2f} ms   EP/TP time ratio {ep / tp:.2f} "
          f"(EP {tp / ep:.2f}x the speed of TP)")
    print(f"  greedy tokens equal in both layouts for {same} of {args.batch} sequences")
    print("\nstagemesh:moe_expert_tokens_total after the workload (EP runner, rank 0's counts):")
    for layer, counts in sorted(result["expert_load"].items(), key=lambda kv: int(kv[0])):
        mean = sum(counts) / len(counts)
        print(f"  layer {layer}: {counts}  max/mean {max(counts) / mean:.2f}")


def rank_argv(args, model: Path | None, rank: int, port: int, out: Path) -> list[str]:
    argv = ["--rank", str(rank), "--port", str(port), "--out", str(out)] + (["--model", str(model)] if model else [])
    for name in ("hidden", "layers", "batch", "prompt_len", "steps", "rounds", "threads", "collective_iters"):
        argv += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    return argv + (["--collectives-only"] if args.collectives_only else [])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a Mixtral/Qwen-MoE checkpoint (default: a random one)")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--moe-intermediate", type=int, default=2048)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--collective-iters", type=int, default=2000)
    p.add_argument("--collectives-only", action="store_true")
    p.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rank is not None:
        return rank_main(args)
    from stagemesh.core.model_config import ModelConfig
    from stagemesh.entry.serve import free_port

    model = None
    if not args.collectives_only:
        model = Path(args.model) if args.model else moe_model_dir(args)
        cfg = ModelConfig.from_path(model)
        cfg.check_expert_parallel(WORLD)
        args.hidden, args.layers, args.experts = cfg.hidden_size, cfg.num_hidden_layers, cfg.num_experts
        args.top_k, args.moe_intermediate = cfg.num_experts_per_tok, cfg.moe_intermediate_size
    out = Path(tempfile.mkdtemp()) / "result.json"
    port = free_port()
    procs = [subprocess.Popen([sys.executable, __file__, *rank_argv(args, model, r, port, out)],
                              env={**os.environ, "OMP_NUM_THREADS": str(args.threads)}) for r in range(WORLD)]
    if any(proc.wait() for proc in procs):
        sys.exit("a rank failed")
    report(args, json.loads(out.read_text()))


if __name__ == "__main__":
    main()
