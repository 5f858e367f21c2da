"""End-to-end decode of a Llama-3.1-8B-shaped model with random bf16 weights made on the GPU:
stagemesh's stage runner (all 32 layers, Triton kernels) against transformers on the same GPU,
and against the memory roofline (weight bytes per step / measured copy bandwidth).

    python benchmarks/bench_decode_gpu.py [--batch 1 16 64 256] [--prompt 128] [--tokens 64]
    python benchmarks/bench_decode_gpu.py --quantization none w8a16 fp8 --no-eager --no-transformers

Decode steps replay CUDA graphs; the same steps run eagerly (--enforce-eager) are printed beside them.
--quantization runs the same model with its linear weights quantised at load (stage_worker.quantization,
kernels/triton_quant.py), one arm after another in the same process; "none" is the bf16 model.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from stagemesh.core.model_config import ModelConfig
from stagemesh.core.sampling_params import SamplingParams
from stagemesh.core.step import NewSequence, ScheduledChunk, StepBatch
from stage_worker.quantization import quantize_at_load
from stage_worker.runner import StageRunner
from stage_worker.weights import init_random_weights

CONFIG = Path(__file__).parents[1] / "stagemesh" / "entry" / "plan" / "reference_configs" / "Llama-3.1-8B.json"


def copy_bandwidth() -> float:
    src = torch.empty(2 * 2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(20):
        dst.copy_(src)
    torch.cuda.synchronize()
    return 2 * src.numel() * 20 / (time.perf_counter() - start)


def stagemesh_decode(runner: StageRunner, batch: int, prompt: int, tokens: int) -> float:
    """Seconds per decode step for `batch` sequences after a prefill of `prompt` tokens each."""
    bs = runner.block_size
    per_seq = -(-(prompt + tokens + 1) // bs)
    runner.reset(batch * per_seq)
    seqs = [NewSequence(i, [100 + i] * prompt, SamplingParams(max_tokens=tokens, ignore_eos=True))
            for i in range(batch)]
    chunks = [ScheduledChunk(i, s.prompt_token_ids, 0, list(range(i * per_seq, (i + 1) * per_seq)), True)
              for i, s in enumerate(seqs)]
    out = runner.execute(StepBatch(0, seqs, chunks))
    last = {t.seq_id: t.token_id for t in out.sampled}
    torch.cuda.synchronize()
    start = None
    for step in range(tokens):
        if step == 3:
            torch.cuda.synchronize()
            start = time.perf_counter()
        decode = [ScheduledChunk(i, [last[i]], prompt + step, [], True) for i in range(batch)]
        out = runner.execute(StepBatch(step + 1, [], decode))
        last = {t.seq_id: t.token_id for t in out.sampled}
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / (tokens - 3)


def transformers_decode(model, batch: int, prompt: int, tokens: int) -> float:
    ids = torch.full((batch, prompt), 100, device="cuda")
    timings = []
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False)
        for n in (4, tokens):
            torch.cuda.synchronize()
            start = time.perf_counter()
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
            torch.cuda.synchronize()
            timings.append(time.perf_counter() - start)
    return (timings[1] - timings[0]) / (tokens - 4)


def build(cfg: ModelConfig, method: str) -> tuple[StageRunner, float]:
    """The runner (random bf16 weights, quantised at load unless `method` is none) and its bytes read a step."""
    runner = StageRunner.of(None, 0, cfg.num_hidden_layers, config=cfg, load=False, device="cuda",
                            dtype=torch.bfloat16)
    init_random_weights(runner.model)
    if method != "none":
        quantize_at_load(runner.model, method)
    torch.cuda.empty_cache()
    weight_bytes = runner.model.num_parameter_bytes() - cfg.vocab_size * cfg.hidden_size * 2  # embedding: 1 row/token
    return runner, weight_bytes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64, 256])
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--quantization", nargs="+", default=["none"], choices=("none", "w8a16", "fp8"))
    p.add_argument("--no-eager", action="store_true")
    p.add_argument("--no-transformers", action="store_true")
    a = p.parse_args()
    cfg = ModelConfig.from_path(CONFIG)
    bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}, copy bandwidth {bw / 1e12:.2f} TB/s (read + write); Llama-3.1-8B shape")
    rows = []
    for method in a.quantization:
        runner, weight_bytes = build(cfg, method)
        roofline = weight_bytes / bw  # a step reads every weight once; copy bandwidth counts bytes read + written
        print(f"{method}: {weight_bytes / 1e9:.1f} GB read per step: roofline {roofline * 1e3:.2f} ms/step", flush=True)
        ours = {b: stagemesh_decode(runner, b, a.prompt, a.tokens) for b in a.batch}
        eager = {}
        if not a.no_eager:
            runner.use_cuda_graphs, runner.graphs = False, None
            runner.kv_caches = []  # reallocate without graphs
            eager = {b: stagemesh_decode(runner, b, a.prompt, a.tokens) for b in a.batch}
        rows.append((method, roofline, ours, eager))
        del runner
        torch.cuda.empty_cache()
    theirs = {}
    if not a.no_transformers:
        from transformers import LlamaConfig, LlamaForCausalLM

        hf = LlamaForCausalLM(LlamaConfig.from_json_file(str(CONFIG))).to(device="cuda", dtype=torch.bfloat16).eval()
        theirs = {b: transformers_decode(hf, b, a.prompt, a.tokens) for b in a.batch}
    base = rows[0][2]
    print(f"{'weights':>8} {'batch':>6} {'stagemesh ms/step':>18} {'tok/s':>9} {'eager ms/step':>14} "
          f"{'transformers ms/step':>21} {'ratio':>6} {'of roofline':>12} {'vs ' + rows[0][0]:>9}")
    for method, roofline, ours, eager in rows:
        for b in a.batch:
            t = theirs.get(b)
            print(f"{method:>8} {b:>6} {ours[b] * 1e3:>18.2f} {b / ours[b]:>9.0f} {eager.get(b, 0) * 1e3:>14.2f} "
                  f"{(t or 0) * 1e3:>21.2f} {(t / ours[b]) if t else 0:>6.2f} {roofline / ours[b]:>12.2f} "
                  f"{base[b] / ours[b]:>8.2f}x")


if __name__ == "__main__":
    main()
