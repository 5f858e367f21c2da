"""Decode steps replayed from CUDA graphs give what the eager forward gives (needs a GPU)."""
from __future__ import annotations

import pytest
import torch

from stagemesh.core.sampling_params import SamplingParams
from stagemesh.core.step import NewSequence, ScheduledChunk, StepBatch
from stage_worker.runner import StageRunner

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need an NVIDIA GPU")


def decode(runner: StageRunner, prompts: list[list[int]], steps: int):
    """Greedy tokens and the logits of every decode step for a batch of prompts."""
    bs, per_seq = runner.block_size, 8
    runner.reset(len(prompts) * per_seq)
    seqs = [NewSequence(i, p, SamplingParams(max_tokens=steps, ignore_eos=True)) for i, p in enumerate(prompts)]
    chunks = [ScheduledChunk(i, p, 0, list(range(i * per_seq, (i + 1) * per_seq)), True) for i, p in enumerate(prompts)]
    out = runner.execute(StepBatch(0, seqs, chunks))
    tokens = {t.seq_id: [t.token_id] for t in out.sampled}
    logits = []
    for step in range(steps):
        batch = [ScheduledChunk(i, [tokens[i][-1]], len(p) + step, [], True) for i, p in enumerate(prompts)]
        out = runner.execute(StepBatch(step + 1, [], batch), return_logits=True)
        logits.append(out.logits)
        for t in out.sampled:
            tokens[t.seq_id].append(t.token_id)
    assert bs * per_seq >= max(map(len, prompts)) + steps + 1
    return [tokens[i] for i in range(len(prompts))], torch.stack(logits)


def test_graph_decode_equals_eager(tiny_model_dir):
    model = tiny_model_dir("llama")
    prompts = [[5, 9, 3], [7] * 11, [2, 4, 6, 8, 10, 12, 1], [3] * 20, [1, 2]]  # 5 sequences: padded to 8
    runs = {}
    for graphs in (True, False):
        runner = StageRunner.of(model, 0, 4, device="cuda", dtype=torch.float32, enforce_eager=not graphs,
                                max_graph_batch=16)
        runs[graphs] = decode(runner, prompts, 24)
        assert (runner.graphs is not None) == graphs
    assert runs[True][0] == runs[False][0]
    torch.testing.assert_close(runs[True][1], runs[False][1], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("a,b", [(0, 2), (1, 3)])  # a first and a middle slice
def test_graph_slice_hidden_states_equal_eager(tiny_model_dir, a, b):
    model = tiny_model_dir("llama")
    outs = []
    for graphs in (True, False):
        runner = StageRunner.of(model, a, b, device="cuda", dtype=torch.float32, enforce_eager=not graphs)
        runner.reset(8)
        hidden = None if a == 0 else torch.randn(3, runner.config.hidden_size, device="cuda",
                                                 generator=torch.Generator("cuda").manual_seed(0))
        seqs = [NewSequence(i, [1 + i] * 4, SamplingParams()) for i in range(3)]
        runner.execute(StepBatch(0, seqs, [ScheduledChunk(i, [1 + i] * 4, 0, [i], False) for i in range(3)]),
                       torch.zeros(12, runner.config.hidden_size, device="cuda") if a else None)
        out = runner.execute(StepBatch(1, [], [ScheduledChunk(i, [9], 4, [], False) for i in range(3)]), hidden)
        outs.append(out.hidden_states)
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-4, atol=1e-4)
