"""Batched sampling (stage_worker/step_on_host.py: one device->host copy per step) against the sampler before it
(one copy per row, read from git at BASE into a temporary module), in one process: per-step sampler time at
batch 1, 8 and 32 on the default vocabulary, a mix of greedy, seeded, top-k/top-p and logprobs rows, and the
tokens of both compared (they must be the same, bit for bit). On a CPU the copies are free and the figures say
what the host work costs; on a GPU each copy is a sync.

    .venv/bin/python benchmarks/bench_sampler_batch.py [--steps 50] [--vocab 49152] [--device cpu] [--base 85e8d91]
"""
from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from stagemesh.core.sampling_params import SamplingParams  # noqa: E402
from stagemesh.core.step import NewSequence  # noqa: E402
from stage_worker.sampler import Sampler  # noqa: E402

MIX = [SamplingParams(), SamplingParams(temperature=0.8, seed=7), SamplingParams(temperature=1.0, top_k=50),
       SamplingParams(temperature=0.7, top_p=0.9, logprobs=5), SamplingParams(logprobs=0),
       SamplingParams(temperature=1.0, min_p=0.05, seed=3), SamplingParams(repetition_penalty=1.2),
       SamplingParams(temperature=0.9, logprobs=2)]


def old_sampler_class(base: str):
    source = subprocess.run(["git", "show", f"{base}:stage_worker/sampler.py"], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "sampler_before.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("sampler_before", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.Sampler


def run(cls, batch: int, logits: list[torch.Tensor], device: str) -> tuple[float, list]:
    torch.manual_seed(0)  # the unseeded rows' generator starts alike in both
    s = cls(device)
    for i in range(batch):
        s.add_sequence(NewSequence(i, [1, 2, 3], MIX[i % len(MIX)], []))
    tokens, times = [], []
    for step_logits in logits:
        if device != "cpu":
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = s.sample(step_logits, list(range(batch)))
        times.append(time.perf_counter() - start)
        tokens.append([(t.token_id, t.logprob, t.top_token_ids, t.top_logprobs) for t in out])
    return sorted(times)[len(times) // 2] * 1e3, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--base", default="85e8d91", help="the commit whose sampler is the baseline")
    a = ap.parse_args()
    before = old_sampler_class(a.base)
    print(f"device {a.device}, vocabulary {a.vocab}, median of {a.steps} steps")
    print("| batch | before, ms/step | after, ms/step | ratio | tokens and logprobs |")
    print("|---|---|---|---|---|")
    for batch in (1, 8, 32):
        gen = torch.Generator().manual_seed(batch)
        logits = [torch.randn(batch, a.vocab, generator=gen).to(a.device) for _ in range(a.steps)]
        run(Sampler, batch, logits[:3], a.device)  # warm both
        run(before, batch, logits[:3], a.device)
        old_ms, old_tokens = run(before, batch, logits, a.device)
        new_ms, new_tokens = run(Sampler, batch, logits, a.device)
        same = "same" if old_tokens == new_tokens else "DIFFER"
        print(f"| {batch} | {old_ms:.3f} | {new_ms:.3f} | {old_ms / new_ms:.2f}x | {same} |")
        if same != "same":
            sys.exit(f"batch {batch}: the tokens differ from the sampler before")


if __name__ == "__main__":
    main()
