"""Decode context parallelism's KV layout (stage_worker.context): which rank keeps which token where, and what
each query row sees of it, against a position-by-position account; and the attention it gives, merged over the
ranks, against attention over the whole sequence."""
from __future__ import annotations

import random

import pytest
import torch

import kernels
from kernels import reference
from stage_worker.context import dcp_metadata, held_count

BLOCK = 16


def owner(position: int, dcp: int) -> int:
    return (position % BLOCK) // (BLOCK // dcp)


@pytest.mark.parametrize("dcp", [1, 2, 4, 8, 16])
def test_held_count_is_the_positions_each_rank_keeps(dcp):
    lengths = torch.arange(0, 5 * BLOCK + 3)
    for rank in range(dcp):
        want = [sum(owner(p, dcp) == rank for p in range(n)) for n in lengths.tolist()]
        assert held_count(lengths, BLOCK, dcp, rank).tolist() == want
    # every position is kept by exactly one rank
    assert sum(held_count(lengths, BLOCK, dcp, r) for r in range(dcp)).tolist() == lengths.tolist()


def _step(rng: random.Random, num_seqs: int = 3):
    """A step of prefill chunks and decode rows over sequences with scattered blocks."""
    free = list(range(64))
    rng.shuffle(free)
    tables, positions, seqs = [], [], []
    for s in range(num_seqs):
        length = rng.randint(1, 70)
        n = 1 if s == 0 else rng.randint(1, length)  # the first a decode row, the others chunks ending the context
        tables.append([free.pop() for _ in range(-(-length // BLOCK))])
        positions += range(length - n, length)
        seqs += [s] * n
    width = max(len(t) for t in tables)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    return table, torch.tensor(positions), torch.tensor(seqs)


@pytest.mark.parametrize("dcp", [2, 4])
def test_each_rank_writes_its_tokens_to_distinct_slots_and_each_row_sees_its_prefix(dcp):
    table, positions, seqs = _step(random.Random(dcp))
    b = BLOCK // dcp
    kept = []
    for rank in range(dcp):
        meta = dcp_metadata(positions, seqs, table, BLOCK, dcp, rank)
        held = meta.held.tolist()
        assert held == [t for t, p in enumerate(positions.tolist()) if owner(p, dcp) == rank]
        for t, slot in zip(held, meta.slot_mapping.tolist()):
            p = int(positions[t])
            assert slot == int(table[seqs[t], p // BLOCK]) * b + p % b  # its block's id, at its offset in the share
        assert len(set(meta.slot_mapping.tolist())) == len(held)
        assert meta.row_visible.tolist() == [sum(owner(q, dcp) == rank for q in range(p + 1))
                                             for p in positions.tolist()]
        assert meta.row_seqs.tolist() == seqs.tolist()
        kept += held
    assert sorted(kept) == list(range(len(positions)))


@pytest.mark.parametrize("dcp", [2, 4])
def test_attention_over_the_shares_merged_is_attention_over_the_sequence(dcp):
    """Every position of every sequence (all of it this step, so each rank's cache holds its whole share) written
    per rank through the metadata; each rank's partial attention, merged, equals the whole sequence's."""
    torch.manual_seed(0)
    table, positions, seqs = _step(random.Random(10 + dcp))
    lengths = [int(positions[seqs == s].max()) + 1 for s in range(table.shape[0])]
    heads, kv_heads, d = 4, 2, 32
    # the step as the whole sequences (positions 0.. of each), so every key is written this step
    positions = torch.cat([torch.arange(n) for n in lengths])
    seqs = torch.cat([torch.full((n,), s) for s, n in enumerate(lengths)])
    q = torch.randn(len(positions), heads, d)
    k, v = torch.randn(len(positions), kv_heads, d), torch.randn(len(positions), kv_heads, d)
    outs, lses = [], []
    for rank in range(dcp):
        meta = dcp_metadata(positions, seqs, table, BLOCK, dcp, rank)
        k_cache = torch.full((64, BLOCK // dcp, kv_heads, d), float("nan"))  # what no one wrote is never read
        v_cache = torch.full_like(k_cache, float("nan"))
        kernels.write_kv_cache(k[meta.held], v[meta.held], k_cache, v_cache, meta.slot_mapping)
        out, lse = kernels.paged_attention_rows_lse(q, k_cache, v_cache, table, meta.row_seqs, meta.row_visible,
                                                    d ** -0.5)
        outs.append(out)
        lses.append(lse)
    merged, _ = kernels.merge_attention_states(torch.stack(outs), torch.stack(lses))
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    for s, n in enumerate(lengths):
        rows = slice(starts[s], starts[s + 1])
        want, _ = reference.attention_lse(q[rows], k[rows], v[rows], torch.arange(n), torch.arange(n), d ** -0.5)
        torch.testing.assert_close(merged[rows], want, atol=1e-5, rtol=1e-5)


class _OneProcess:
    """A PCP group of ranks in one process: what each rank gives, gathered in rank order."""

    def __init__(self, parts: list[torch.Tensor]):
        self.parts = parts

    def cp_gather(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack(self.parts)


@pytest.mark.parametrize("pcp", [2, 4])
def test_prefill_cp_gives_each_token_to_the_rank_that_keeps_its_kv_and_gathers_them_back(pcp):
    from stage_worker.context import TokenSplit

    table, positions, seqs = _step(random.Random(20 + pcp))
    splits = [TokenSplit(positions, BLOCK, pcp, rank) for rank in range(pcp)]
    tokens = torch.arange(len(positions)) * 10 + 7  # anything that tells the tokens apart
    for rank, split in enumerate(splits):
        rows = split.rows(tokens)
        assert len(rows) == split.pad == max(len(s.mine) for s in splits)
        n = len(split.mine)
        assert [owner(int(positions[t]), pcp) for t in split.mine] == [rank] * n  # its own tokens, in order
        assert rows[:n].tolist() == tokens[split.mine].tolist() and not rows[n:].any()  # then padding
        meta = split.metadata(positions, seqs, table, BLOCK, rank)
        assert meta.pad == split.pad and meta.held.tolist() == list(range(n))
        # every gathered row (each rank's rows, padded) sees the positions this rank keeps at or before it
        gathered = [t for s in splits for t in s.gathered[s.rank].tolist()]
        assert meta.row_visible.tolist() == [0 if t < 0 else sum(owner(q, pcp) == rank for q in
                                                                 range(int(positions[t]) + 1)) for t in gathered]
    group = _OneProcess([s.rows(tokens) for s in splits])
    assert all(torch.equal(s.gather(s.rows(tokens), group), tokens) for s in splits)
