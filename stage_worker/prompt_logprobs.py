"""Logprobs of prompt tokens on the last stage (a request's prompt_logprobs; echo with logprobs, as
lm-evaluation-harness scores multiple choice): position p's logits give token p + 1 its logprob.

Only the rows of the sequences that ask are put through the LM head, a slice at a time (a 2,048-token
chunk of a 49k vocabulary would be 400 MB of logits at once). Every TP rank takes part (the LM head
all-gathers); TP rank 0 keeps the results.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from stagemesh.core.step import PromptLogprobs, StepBatch, TokenLogprob
from stage_worker.host_copy import to_host

ROWS_PER_SLICE = 256


@dataclass
class _Piece:
    """The rows of one chunk whose next token is a prompt token."""
    seq_id: int
    start: int  # prompt position of the first target token
    rows: list[int]
    targets: list[int]
    top_n: int


def pieces_of(batch: StepBatch, seqs: dict) -> list[_Piece]:
    """What the step must score: for each chunk of a sequence with prompt_logprobs, its positions p whose
    next token p + 1 is still in the prompt."""
    pieces, row = [], 0
    c = batch.chunks
    for seq_id, n, start in zip(c.seq_ids, c.num_tokens, c.start_positions):
        state = seqs.get(seq_id)
        if state is not None and state.params.prompt_logprobs is not None:
            end = min(start + n, len(state.prompt) - 1)  # the prompt's last position predicts a new token
            if end > start:
                pieces.append(_Piece(seq_id, start + 1, list(range(row + 0, row + end - start)),
                                     state.prompt[start + 1:end + 1], state.params.prompt_logprobs))
        row += n
    return pieces


@torch.inference_mode()
def compute(pieces: list[_Piece], hidden: torch.Tensor, compute_logits, keep: bool) -> list[PromptLogprobs]:
    """Score the pieces' rows of `hidden` (the last stage's normed hidden states); `keep` on TP rank 0."""
    rows = [r for p in pieces for r in p.rows]
    target_ids = [t for p in pieces for t in p.targets]
    targets = torch.tensor(target_ids, dtype=torch.int64, device=hidden.device)
    top_n = [p.top_n for p in pieces for _ in p.rows]
    k = max(top_n)
    own, ranks, top_ids, top_values = [], [], [], []  # on the device, a slice at a time
    for lo in range(0, len(rows), ROWS_PER_SLICE):
        index = torch.tensor(rows[lo:lo + ROWS_PER_SLICE], dtype=torch.int64, device=hidden.device)
        logprobs = torch.log_softmax(compute_logits(hidden.index_select(0, index)), dim=-1)
        if not keep:
            continue
        own.append(logprobs.gather(1, targets[lo:lo + ROWS_PER_SLICE, None]))
        ranks.append((logprobs > own[-1]).sum(dim=-1) + 1)
        if k:
            top = torch.topk(logprobs, k, dim=-1)
            top_ids.append(top.indices)
            top_values.append(top.values)
    if not keep:
        return []
    results = _entries(target_ids, own, ranks, top_ids, top_values, top_n)
    out, at = [], 0
    for p in pieces:
        out.append(PromptLogprobs(p.seq_id, p.start, results[at:at + len(p.rows)]))
        at += len(p.rows)
    return out


def _entries(targets: list[int], own: list[torch.Tensor], ranks: list[torch.Tensor], top_ids: list[torch.Tensor],
             top_values: list[torch.Tensor], top_n: list[int]) -> list[TokenLogprob]:
    """Every scored row's entry, its slices' tensors brought to the host in one copy (not one per row)."""
    tops = [torch.cat(top_ids), torch.cat(top_values)] if top_ids else []
    host = to_host([torch.cat(own)[:, 0], torch.cat(ranks)] + tops)
    ids, values = (host[2].tolist(), host[3].tolist()) if top_ids else ([], [])
    results = []
    for i, (t, lp, rank) in enumerate(zip(targets, host[0].tolist(), host[1].tolist())):
        entry, n = TokenLogprob(t, lp, rank), top_n[i]
        if n:
            entry.top_token_ids, entry.top_logprobs = ids[i][:n], values[i][:n]
        results.append(entry)
    return results
