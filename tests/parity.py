"""Helpers for parity tests: chained stage slices driven step by step."""
from __future__ import annotations

import random

import torch

from stagemesh.core.model_config import layer_ranges
from stagemesh.core.sampling_params import SamplingParams
from stagemesh.core.step import NewSequence, ScheduledChunk, StepBatch
from stage_worker.runner import StageRunner


def prompts(vocab: int, lengths=(5, 40, 17, 70, 3, 33), seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def chained_logits(model_dir, split, prompt, new_tokens, chunk=16, tp_rank=0, tp_size=1, tp_group=None,
                   expert_parallel=False, dtype=None, kv_scales_out: list | None = None, **runner_kw):
    """Run the slices by hand: the prompt in chunks of `chunk`, then greedy decode; logits per token.
    runner_kw: more of StageRunner's arguments (quantization, gguf_file, kv_cache_dtype). kv_scales_out: each
    slice's KV cache scales at the end are appended to it."""
    runners = [StageRunner.of(model_dir, a, b, tp_rank=tp_rank, tensor_parallel_size=tp_size, tp_group=tp_group,
                              enable_expert_parallel=expert_parallel, dtype=dtype, **runner_kw)
               for a, b in layer_ranges(split)]
    groups = runners[0].kv_groups.num_groups  # (KV cache groups: each its own 64 blocks, its own new ones per step)
    for r in runners:
        r.allocate_kv_cache(64 * groups)
    seq = NewSequence(0, prompt, SamplingParams(max_tokens=new_tokens))
    tokens, logits, step, pos, table = list(prompt), [], 0, 0, 0
    while len(logits) < new_tokens:
        n = min(chunk, len(tokens) - pos)
        need = -(-(pos + n) // 16)
        batch = StepBatch(step, [seq] if step == 0 else [],
                          [ScheduledChunk(0, tokens[pos:pos + n], pos,
                                          [g * 64 + i for g in range(groups) for i in range(table, need)],
                                          pos + n == len(tokens))])
        table = max(table, need)
        hidden = None
        for r in runners:
            out = r.execute(batch, hidden, return_logits=True)
            hidden = out.hidden_states
        pos, step = pos + n, step + 1
        row = out.logits[0] if out.logits is not None else None  # every TP rank has the gathered logits,
        if runners[-1].tp.pcp and pos == len(tokens):  # but with PCP only rank 0's place: every rank takes rank 0's
            row = row if row is not None else torch.empty(runners[-1].config.vocab_size)
            torch.distributed.broadcast(row, src=0, group=tp_group)
        if row is not None:  # greedy is argmax
            tokens.append(int(row.argmax()))
            logits.append(row)
    if kv_scales_out is not None:
        kv_scales_out += [r.kv_scales.values() for r in runners]
    return tokens[len(prompt):], torch.stack(logits)
