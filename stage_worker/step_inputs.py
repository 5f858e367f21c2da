"""A step's inputs on one stage rank: the token ids, the attention metadata (positions, slots, block tables) and
the rows the last stage samples, from the StepBatch and the block tables the runner keeps."""
from __future__ import annotations

from dataclasses import replace

import torch

from stagemesh.core.step import StepBatch
from stage_worker.context import share_step
from stage_worker.model import AttentionMetadata


def step_inputs(batch: StepBatch, block_tables: dict[int, list[int]], block_size: int, device: torch.device, tp,
                first_stage: bool, group_tables: list[dict[int, list[int]]] | None = None):
    """(input_ids, metadata, sample_rows, sample_ids, drafts): `tp` the stage's group (its context-parallel
    share of the tokens is this rank's: stage_worker.context); input_ids only on the first stage. group_tables:
    the tables of the KV cache groups after the first (block_tables), each given its view in metadata.groups."""
    bs, c = block_size, batch.chunks
    positions: list[int]
    slots: list[int]
    sample_rows: list[int]
    positions, slots, context_lens, starts = [], [], [], [0]
    sample_rows, sample_ids, drafts = [], [], []
    tables = [block_tables[s] for s in c.seq_ids]
    for seq_id, table, n, p0, sample, d in zip(c.seq_ids, tables, c.num_tokens, c.start_positions, c.sample,
                                               c.draft_counts()):
        pos = range(p0, p0 + n)  # covered by the sequence's blocks (validate.check_state, for steps from outside)
        positions.extend(pos)
        if tp.cp_size == 1:  # (a context-parallel rank's slots are its share's: stage_worker.context)
            slots.extend(table[p // bs] * bs + p % bs for p in pos)
        context_lens.append(p0 + n)
        starts.append(starts[-1] + n)
        if sample:  # the logits of the chunk's last token, and of each draft (verified against them)
            sample_rows.extend(range(starts[-1] - 1 - d, starts[-1]))
            sample_ids.append(seq_id)
            drafts.append(c.token_ids[starts[-1] - d:starts[-1]])
    width = max(len(t) for t in tables)
    meta = AttentionMetadata(
        positions=torch.tensor(positions, dtype=torch.int64, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device),
        context_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
    )
    if group_tables:
        meta.groups = (meta, *(_group_view(meta, batch, tables, bs, device) for tables in group_tables))
    input_ids = torch.tensor(c.token_ids, dtype=torch.int64, device=device) if first_stage else None
    if tp.cp_size > 1:  # this rank's share of the tokens (its slots: there, not slot_mapping's)
        input_ids = share_step(meta, input_ids, c.num_tokens, bs, tp)
    return input_ids, meta, sample_rows, sample_ids, drafts


def _group_view(meta: AttentionMetadata, batch: StepBatch, block_tables: dict[int, list[int]], bs: int,
                device: torch.device) -> AttentionMetadata:
    """The step's metadata for a KV cache group's layers: its tables and the slots of the step's tokens in them."""
    c = batch.chunks
    tables = [block_tables[s] for s in c.seq_ids]
    slots = [table[p // bs] * bs + p % bs for table, n, p0 in zip(tables, c.num_tokens, c.start_positions)
             for p in range(p0, p0 + n)]
    width = max(len(t) for t in tables)
    return replace(meta, slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
                   block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32,
                                             device=device))
