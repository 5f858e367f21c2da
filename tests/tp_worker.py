"""One TP rank of a parity run (started by test_tp_parity as a real process).

Joins a gloo group on loopback, runs the chained slices at this rank, and
rank 0 writes the greedy tokens and logits as JSON (nothing is pickled).
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from parity import chained_logits  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model"), p.add_argument("--rank", type=int), p.add_argument("--world", type=int)
    p.add_argument("--port", type=int), p.add_argument("--split"), p.add_argument("--prompt")
    p.add_argument("--new-tokens", type=int), p.add_argument("--out")
    p.add_argument("--expert-parallel", action="store_true")
    p.add_argument("--dcp", type=int, default=1)
    p.add_argument("--pcp", type=int, default=1)
    p.add_argument("--chunk", type=int, default=16)
    p.add_argument("--kv-cache-dtype", default=None)
    p.add_argument("--calculate-kv-scales", action="store_true")
    a = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{a.port}", rank=a.rank, world_size=a.world)
    try:
        split = [int(x) for x in a.split.split(",")]
        prompt = [int(x) for x in a.prompt.split(",")]
        context: dict = {"decode_context_parallel_size": a.dcp} if a.dcp > 1 \
            else {"prefill_context_parallel_size": a.pcp} if a.pcp > 1 else {}
        if a.pcp > 1 and a.world > a.pcp:  # PCP with TP: this rank's TP group, ranks of its place in each PCP group
            groups = [dist.new_group(list(range(c, a.world, a.pcp))) for c in range(a.pcp)]
            context["shard_group"] = groups[a.rank % a.pcp]
        if a.kv_cache_dtype:
            context.update(kv_cache_dtype=a.kv_cache_dtype, calculate_kv_scales=a.calculate_kv_scales)
        scales: list = []
        tokens, logits = chained_logits(a.model, split, prompt, a.new_tokens, tp_rank=a.rank, tp_size=a.world // a.pcp,
                                        tp_group=dist.group.WORLD, expert_parallel=a.expert_parallel,
                                        chunk=a.chunk, kv_scales_out=scales, **context)
        if a.kv_cache_dtype:  # every rank's KV cache scales, the first slice's
            with open(f"{a.out}.scales{a.rank}", "w") as f:
                json.dump(scales[0], f)
        if a.rank == 0:
            with open(a.out, "w") as f:
                json.dump({"tokens": tokens, "logits": logits.tolist()}, f)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
