"""The int8-activation fast path's accuracy contract (issue 57): over an evaluation text, teacher-forced, its
KL divergence from the weight-only (exact) path must be at most 0.1x the KL divergence the weight quantization
itself adds against the bf16 model, and its top-1 token must agree with the exact path's at 99% of positions."""
from __future__ import annotations

import torch

from stagemesh.core.sampling_params import SamplingParams
from stagemesh.core.step import NewSequence, ScheduledChunk, StepBatch
from stage_worker import layers
from stage_worker.quant_weight import QuantizedWeight

MAX_KL_RATIO = 0.1
MIN_TOP1 = 0.99
# an evaluation slice of plain English prose (the lm-eval tasks themselves are not at hand offline)
EVAL_TEXT = (
    "The lighthouse stood at the end of the long stone pier, and every night for forty years the keeper climbed its "
    "narrow stairs to light the lamp. Ships passing in the dark relied on its steady beam to find the harbour. "
    "In the spring the village held a market in the square, where farmers sold cheese, bread and early vegetables, "
    "and children ran between the stalls. The schoolteacher, who had come from the city many years before, taught "
    "arithmetic in the morning and history in the afternoon, and on Fridays she read stories aloud. "
    "Water boils at one hundred degrees Celsius at sea level, and the boiling point falls as the air pressure drops, "
    "which is why cooking takes longer in the mountains. The capital of France is Paris, the capital of Italy is "
    "Rome, and the capital of Spain is Madrid. A triangle has three sides, a square has four, and a hexagon has six. "
    "To make a cup of tea, boil fresh water, warm the pot, add the leaves, pour the water over them and wait three "
    "to five minutes before serving. The train left the station at seven, crossed the river at eight and reached "
    "the coast a little before noon, where the passengers stepped out into the bright salt air.")
_seq_id = 0  # each pass a new sequence of the runner


@torch.inference_mode()
def teacher_forced_logits(runner, ids: list[int], chunk: int = 32) -> torch.Tensor:
    """fp32 logits [len(ids) - 1, vocab] of a one-stage runner at every position but the last: the text fed in
    chunks whose every row is scored (all but the first token of a chunk marked as drafts, so the step returns
    the logits of each row: the drafts' verification is not used)."""
    global _seq_id
    _seq_id += 1
    runner.allocate_kv_cache(-(-len(ids) // 16) + 1)
    seq = NewSequence(_seq_id, ids, SamplingParams(max_tokens=1))
    rows = []
    for step, pos in enumerate(range(0, len(ids) - 1, chunk)):
        n = min(chunk, len(ids) - 1 - pos)
        blocks = list(range(-(-pos // 16), -(-(pos + n) // 16)))
        batch = StepBatch(step, [seq] if step == 0 else [],
                          [ScheduledChunk(_seq_id, ids[pos:pos + n], pos, blocks, True, n - 1)])
        out = runner.execute(batch, return_logits=True)
        rows.append(out.logits)
    return torch.cat(rows)


def set_int8_activations(model, on: bool) -> int:
    """Every quantised linear of the model on the int8-activation path (on) or the exact one; how many."""
    count = 0
    for m in model.modules():
        if isinstance(m, QuantizedWeight) and m.qs.dtype in (torch.int8, torch.uint8):
            m.int8_activations = on
            count += 1
    layers._changed()  # the layers' C++ plans took the old flag: they rebuild (stage_worker.layer_plan)
    return count


def kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    """Mean over positions of KL(p || q), p the reference distribution."""
    p, q = torch.log_softmax(p_logits.double(), -1), torch.log_softmax(q_logits.double(), -1)
    return float((p.exp() * (p - q)).sum(-1).mean())


def top1(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.argmax(-1) == b.argmax(-1)).double().mean())
