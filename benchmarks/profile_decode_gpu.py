"""Where one batch-1 (or batch-N) decode step's time goes on a GPU, in-process:
host-side preparation, the CUDA-graph replay of the layers and LM head, sampling.

    python benchmarks/profile_decode_gpu.py [--batch 1 32] [--steps 50]
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from stagemesh.core.model_config import ModelConfig
from stagemesh.core.sampling_params import SamplingParams
from stagemesh.core.step import NewSequence, ScheduledChunk, StepBatch
from stage_worker.runner import StageRunner
from stage_worker.weights import init_random_weights

CONFIG = Path(__file__).parents[1] / "stagemesh" / "entry" / "plan" / "reference_configs" / "Llama-3.1-8B.json"


def profile(runner: StageRunner, batch: int, steps: int, prompt: int = 128) -> dict[str, float]:
    per_seq = -(-(prompt + steps + 8) // runner.block_size)
    runner.reset(batch * per_seq)
    seqs = [NewSequence(i, [100 + i] * prompt, SamplingParams(max_tokens=steps + 8, ignore_eos=True))
            for i in range(batch)]
    chunks = [ScheduledChunk(i, s.prompt_token_ids, 0, list(range(i * per_seq, (i + 1) * per_seq)), True)
              for i, s in enumerate(seqs)]
    last = {t.seq_id: t.token_id for t in runner.execute(StepBatch(0, seqs, chunks)).sampled}
    parts = {"prepare (host)": 0.0, "layers + LM head (graph replay)": 0.0, "sample (incl. sync)": 0.0}
    total = 0.0
    for step in range(steps):
        decode = [ScheduledChunk(i, [last[i]], prompt + step, [], True) for i in range(batch)]
        b = StepBatch(step + 1, [], decode)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        runner._update_state(b)
        ids, meta, _, sample_ids = runner._prepare(b)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        logits = runner.graphs.run(ids, None, meta)
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        sampled = runner.sampler.sample(logits, sample_ids)
        t3 = time.perf_counter()
        last = {t.seq_id: t.token_id for t in sampled}
        if step >= 3:
            for key, dt in zip(parts, (t1 - t0, t2 - t1, t3 - t2)):
                parts[key] += dt
            total += t3 - t0
    n = steps - 3
    return {**{k: v / n for k, v in parts.items()}, "total": total / n}


def gemv_floor(runner: StageRunner, batch: int, repeats: int = 20) -> float:
    """Seconds for the step's matrix products alone (F.linear over every layer's weights and the LM head, as
    the model calls them), replayed from one CUDA graph: what cuBLAS gives before any other kernel."""
    import torch.nn.functional as F

    weights = [m.weight for m in runner.model.modules() if hasattr(m, "weight") and m.weight is not None
               and m.weight.dim() == 2 and m is not runner.model.embed_tokens]
    x = {w.shape[1]: torch.randn(batch, w.shape[1], device="cuda", dtype=w.dtype) for w in weights}

    def products():
        return [F.linear(x[w.shape[1]], w) for w in weights]

    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        products()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            products()
    torch.cuda.synchronize()
    graph.replay()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    p.add_argument("--steps", type=int, default=50)
    a = p.parse_args()
    cfg = ModelConfig.from_path(CONFIG)
    runner = StageRunner.of(None, 0, cfg.num_hidden_layers, config=cfg, load=False, device="cuda", dtype=torch.bfloat16)
    init_random_weights(runner.model)
    for b in a.batch:
        r = profile(runner, b, a.steps)
        print(f"batch {b}: " + ", ".join(f"{k} {v * 1e3:.3f} ms" for k, v in r.items()))
        print(f"batch {b}: the matrix products alone (one CUDA graph): {gemv_floor(runner, b) * 1e3:.3f} ms")


if __name__ == "__main__":
    main()
