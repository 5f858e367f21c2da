"""One TP rank of test_lora's TP=2 run (a real process in a gloo group): a mixed-adapter batch over the
stage's layers; rank 0 writes the tokens as JSON (nothing is pickled).

    python lora_tp_worker.py RANK WORLD PORT SPEC_JSON
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from lora_cases import run_mixed, runners, settings  # noqa: E402


def main() -> None:
    rank, world, port, spec = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        stages = runners(spec["model"], [4], settings(spec["adapters"]), tp_rank=rank, tp_size=world,
                         tp_group=dist.group.WORLD, decode_context_parallel_size=spec.get("dcp", 1))
        tokens = run_mixed(stages, [(p, n) for p, n in spec["seqs"]], spec["new_tokens"])
        if rank == 0:
            with open(spec["out"], "w") as f:
                json.dump(tokens, f)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
