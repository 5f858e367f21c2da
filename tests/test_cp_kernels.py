"""The kernels context parallelism is built on (docs/context-parallelism.md): paged attention that returns
the log-sum-exp beside its output, and the merge of partial attentions by their log-sum-exps. The torch
references against a naive softmax; the property CP rests on (a sequence's keys split over R ranks,
attended per rank and merged, equal attention over all of them); the Triton kernels (interpreted on CPU)
and the C++ CPU kernels against the references, fp32 and bf16; the partials of no keys."""
from __future__ import annotations

import math

import pytest
import torch

from kernel_cases import CASES, dense_attention, paged_case
from kernels import cpu_ops, dispatch, reference

TOL = dict(atol=2e-5, rtol=2e-5)
BF16_TOL = dict(atol=2e-2, rtol=2e-2)
NEG_INF = float("-inf")


def naive_lse(q, k_cache, v_cache, tables, ctx, qsl, scale) -> torch.Tensor:
    """log sum_t exp(q . k_t * scale) over the positions each row sees, in float64, one row at a time."""
    lse = torch.empty(q.shape[:2], dtype=torch.float64)
    bs, group = k_cache.shape[1], q.shape[1] // k_cache.shape[2]
    for s in range(ctx.shape[0]):
        c, lo, hi = int(ctx[s]), int(qsl[s]), int(qsl[s + 1])
        rows = torch.arange(c)
        k = k_cache[tables[s, rows // bs].long(), rows % bs].double().repeat_interleave(group, 1)  # [c, H, d]
        for i in range(hi - lo):
            seen = k[: c - (hi - lo) + i + 1]
            scores = (q[lo + i].double()[None] * seen).sum(-1) * scale  # [t, H]
            lse[lo + i] = scores.exp().sum(0).log()
    return lse


def owners(num_blocks: int, ranks: int, layout: str) -> list[int]:
    """The rank that holds each of a sequence's blocks: round robin (CP's layout, decode appends spread
    evenly) or contiguous ranges."""
    if layout == "round-robin":
        return [b % ranks for b in range(num_blocks)]
    return [b * ranks // num_blocks for b in range(num_blocks)]


def rank_share(args, rank: int, ranks: int, layout: str):
    """A decode batch as rank `rank` of `ranks` sees it: each sequence's block table holds only its own
    blocks, in order, and its context length counts only their positions (0 where it holds none)."""
    q, k_cache, v_cache, tables, ctx, qsl = args
    bs = k_cache.shape[1]
    local_tables = torch.zeros_like(tables)
    local_ctx = torch.zeros_like(ctx)
    for s, c in enumerate(ctx.tolist()):
        n = math.ceil(c / bs)
        mine = [b for b, owner in enumerate(owners(n, ranks, layout)) if owner == rank]
        local_tables[s, : len(mine)] = tables[s, mine]
        local_ctx[s] = sum(min(bs, c - b * bs) for b in mine)
    return q, k_cache, v_cache, local_tables, local_ctx, qsl


def test_merge_of_one_partial_is_itself_and_order_does_not_matter():
    g = torch.Generator().manual_seed(0)
    out, lse = torch.randn(3, 5, 4, 16, generator=g), torch.randn(3, 5, 4, generator=g) * 4
    merged, merged_lse = reference.merge_attention_states(out[:1], lse[:1])
    torch.testing.assert_close(merged, out[0], **TOL)
    torch.testing.assert_close(merged_lse, lse[0], **TOL)
    a = reference.merge_attention_states(out, lse)
    b = reference.merge_attention_states(out.flip(0), lse.flip(0))
    torch.testing.assert_close(a, b, **TOL)
    # two partials of equal lse weigh alike, and the merged lse adds log 2
    torch.testing.assert_close(reference.merge_attention_states(out[:2], lse[:1].expand(2, -1, -1))[1],
                               lse[0] + math.log(2), **TOL)


@pytest.mark.parametrize("name", list(CASES))
def test_reference_lse_equals_naive_softmax(name):
    lens_q, lens_ctx, heads, kv_heads, d = CASES[name]
    args = paged_case(lens_q, lens_ctx, heads, kv_heads, d)
    out, lse = reference.paged_attention_lse(*args, d ** -0.5)
    torch.testing.assert_close(out, dense_attention(*args, d ** -0.5), **TOL)
    torch.testing.assert_close(out, reference.paged_attention(*args, d ** -0.5), **TOL)
    torch.testing.assert_close(lse.double(), naive_lse(*args, d ** -0.5), **TOL)


@pytest.mark.parametrize("layout", ["round-robin", "contiguous"])
@pytest.mark.parametrize("ranks", [2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_split_over_ranks_and_merged_equals_attention_over_all(layout, ranks, dtype):
    """Decode context parallelism: each rank attends every decode row to its own blocks, the partials merge
    into the attention over the whole context; a sequence shorter than `ranks` blocks leaves a rank empty."""
    args = paged_case([1] * 5, [1, 16, 40, 100, 161], 6, 2, 64, dtype=dtype, seed=3)
    want, want_lse = reference.paged_attention_lse(*args, 0.125)
    parts = [reference.paged_attention_lse(*rank_share(args, r, ranks, layout), 0.125) for r in range(ranks)]
    assert bool(torch.isneginf(parts[-1][1][0]).all()), "the one-position sequence leaves the last rank empty"
    out, lse = reference.merge_attention_states(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]))
    torch.testing.assert_close(out, want, **(TOL if dtype == torch.float32 else BF16_TOL))
    torch.testing.assert_close(lse, want_lse, **TOL)


@pytest.mark.parametrize("layout", ["round-robin", "contiguous"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_chunk_split_over_ranks_and_merged_equals_attention_over_all(layout, dtype):
    """Ring attention's merge: a prefill chunk (causal, GQA) attended to each rank's share of the keys at
    their true positions, merged, equals the chunk's attention over all of them; the chunk's early rows
    see none of a late share (lse -inf), which the merge drops."""
    args = paged_case([70], [150], 6, 2, 64, dtype=dtype, seed=4)
    q, k_cache, v_cache, tables, ctx, qsl = args
    k, v = reference._gather(k_cache, tables[0], 150), reference._gather(v_cache, tables[0], 150)
    positions = torch.arange(150)
    q_positions = positions[150 - 70:]
    want, want_lse = reference.paged_attention_lse(*args, 0.125)
    for ranks in (2, 3, 5):
        owner = torch.tensor(owners(math.ceil(150 / 16), ranks, layout))[positions // 16]
        parts = [reference.attention_lse(q, k[owner == r], v[owner == r], q_positions, positions[owner == r], 0.125)
                 for r in range(ranks)]
        lses = torch.stack([p[1] for p in parts])
        if layout == "contiguous" and ranks > 2:  # the last share starts past the chunk's first row
            assert bool(torch.isneginf(lses[-1, 0]).all()), "the chunk's first row sees nothing of the last share"
        out, lse = reference.merge_attention_states(torch.stack([p[0] for p in parts]), lses)
        torch.testing.assert_close(out, want, **(TOL if dtype == torch.float32 else BF16_TOL))
        torch.testing.assert_close(lse, want_lse, **TOL)


def test_merge_of_empty_partials_gives_zero_and_minus_infinity_never_nan():
    out = torch.randn(3, 2, 2, 16)
    out[1] = float("nan")  # an empty partial's output is whatever its kernel left: it must not leak
    lse = torch.randn(3, 2, 2)
    lse[1] = NEG_INF
    lse[:, 1, 0] = NEG_INF  # row 1, head 0: every partial empty
    merged, merged_lse = reference.merge_attention_states(out, lse)
    assert not bool(merged.isnan().any()) and not bool(merged_lse.isnan().any())
    assert bool((merged[1, 0] == 0).all()) and bool(torch.isneginf(merged_lse[1, 0]))
    keep = torch.tensor([0, 2])
    want, want_lse = reference.merge_attention_states(out[keep], lse[keep])
    torch.testing.assert_close(merged, want, **TOL)
    torch.testing.assert_close(merged_lse, want_lse, **TOL)
    # and every implementation agrees on it
    for impl in implementations():
        got, got_lse = impl.merge_attention_states(out, lse)
        torch.testing.assert_close(got, merged, **TOL)
        torch.testing.assert_close(got_lse, merged_lse, **TOL)


def implementations(attention_dtype: torch.dtype = torch.float32) -> list:
    """The kernel modules with paged_attention_lse and merge_attention_states that run here. Triton's
    interpreter computes the bf16 attention wrong (its paged_attention without the lse as well, a limit of
    the interpreter's bf16 dot): its bf16 attention is checked on a GPU (benchmarks/bench_kernels_gpu.py)."""
    impls = []
    try:
        from kernels import triton_attention

        if attention_dtype == torch.float32 or torch.cuda.is_available():
            impls.append(triton_attention)
    except ImportError:
        pass
    if cpu_ops.load() is not None:
        impls.append(cpu_ops)
    return impls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(CASES))
def test_kernels_lse_equal_reference(name, dtype):
    lens_q, lens_ctx, heads, kv_heads, d = CASES[name]
    args = paged_case(lens_q, lens_ctx, heads, kv_heads, d, dtype=dtype)
    want, want_lse = reference.paged_attention_lse(*args, d ** -0.5)
    for impl in implementations(dtype):
        out, lse = impl.paged_attention_lse(*args, d ** -0.5)
        assert out.dtype == dtype and lse.dtype == torch.float32 and lse.shape == q_shape(args)
        torch.testing.assert_close(out, want, **(TOL if dtype == torch.float32 else BF16_TOL))
        torch.testing.assert_close(lse, want_lse, **(TOL if dtype == torch.float32 else dict(atol=1e-3, rtol=1e-3)))
        # and the output is the one paged_attention gives without the lse, bit for bit where one kernel serves
        # both (without a family for the head_dim, the CPU's lse comes from the fp32 reference)
        without = impl.paged_attention(*args, d ** -0.5)
        if impl is cpu_ops and not cpu_ops.covers(cpu_ops.current_attention_family(), d):
            torch.testing.assert_close(out, without, **(TOL if dtype == torch.float32 else BF16_TOL))
        else:
            assert torch.equal(out, without)


def q_shape(args) -> torch.Size:
    return args[0].shape[:2]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernels_split_and_merge_for_decode(dtype):
    """Each kernel's partials over round-robin shares (one of them empty for a short sequence), merged by each
    kernel's merge, against the reference over the whole context; a long single row takes the C++ kernel's
    split-per-thread path."""
    for lens in ([1, 16, 40, 100, 161], [700]):
        args = paged_case([1] * len(lens), lens, 8, 2, 64, dtype=dtype, seed=6)
        want, want_lse = reference.paged_attention_lse(*args, 0.125)
        for impl in implementations(dtype):
            parts = [impl.paged_attention_lse(*rank_share(args, r, 3, "round-robin"), 0.125) for r in range(3)]
            out, lse = impl.merge_attention_states(torch.stack([p[0] for p in parts]),
                                                   torch.stack([p[1] for p in parts]))
            torch.testing.assert_close(out, want, **(TOL if dtype == torch.float32 else BF16_TOL))
            torch.testing.assert_close(lse, want_lse, **(TOL if dtype == torch.float32 else dict(atol=1e-3, rtol=1e-3)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernels_merge_equals_reference(dtype):
    g = torch.Generator().manual_seed(7)
    out = torch.randn(4, 9, 6, 128, generator=g).to(dtype)
    lse = torch.randn(4, 9, 6, generator=g) * 3
    lse[2, :4] = NEG_INF
    want, want_lse = reference.merge_attention_states(out, lse)
    for impl in implementations():
        got, got_lse = impl.merge_attention_states(out, lse)
        assert got.dtype == dtype and got_lse.dtype == torch.float32
        torch.testing.assert_close(got, want, **(TOL if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)))
        torch.testing.assert_close(got_lse, want_lse, **TOL)


def test_dispatch_entries():
    args = paged_case([1, 9], [20, 9], 4, 2, 64)
    out, lse = dispatch.paged_attention_lse(*args, 0.125)
    want, want_lse = reference.paged_attention_lse(*args, 0.125)
    torch.testing.assert_close(out, want, **TOL)
    torch.testing.assert_close(lse, want_lse, **TOL)
    merged = dispatch.merge_attention_states(torch.stack([out, out]), torch.stack([lse, lse]))
    torch.testing.assert_close(merged[0], out, **TOL)
    torch.testing.assert_close(merged[1], lse + math.log(2), **TOL)


def test_cpu_lse_of_a_long_row_cut_over_threads():
    """One long fp32 row on two threads: the C++ kernel cuts it into a piece per thread and merges the pieces'
    sums (decode_attention_impl.h, run_pieces), where its lse comes from."""
    if cpu_ops.load() is None:
        pytest.skip("the CPU kernels could not be built here")
    args = paged_case([1], [700], 8, 2, 64, seed=8)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        out, lse = cpu_ops.paged_attention_lse(*args, 0.125)
    finally:
        torch.set_num_threads(threads)
    want, want_lse = reference.paged_attention_lse(*args, 0.125)
    torch.testing.assert_close(out, want, **TOL)
    torch.testing.assert_close(lse, want_lse, **TOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_kernel_prefill_chunk_over_rank_shares_by_visible_counts(dtype):
    """The C++ kernel takes each query row's count of visible positions, so it already attends a prefill chunk
    to a rank's share of the keys at their true positions (ring attention's rounds): row i sees the share's
    positions up to its own, a prefix of the share's block table; rows that see none give 0 and -inf."""
    if cpu_ops.load() is None or not cpu_ops.covers(cpu_ops.current_attention_family(), 64):
        pytest.skip("no C++ family kernel for head_dim 64 here")
    q, k_cache, v_cache, tables, ctx, qsl = args = paged_case([70], [150], 6, 2, 64, dtype=dtype, seed=9)
    want, want_lse = reference.paged_attention_lse(*args, 0.125)
    q_positions = torch.arange(150 - 70, 150)
    for layout in ("round-robin", "contiguous"):
        local_args = [rank_share(args, r, 3, layout) for r in range(3)]
        parts = []
        for r, (_, _, _, local_tables, _, _) in enumerate(local_args):
            mine = [b for b, owner in enumerate(owners(10, 3, layout)) if owner == r]
            positions = torch.tensor([b * 16 + i for b in mine for i in range(16) if b * 16 + i < 150])
            visible = (positions[None, :] <= q_positions[:, None]).sum(1).to(torch.int32)
            parts.append(cpu_ops.load().decode_attention_lse(q, k_cache, v_cache, local_tables,
                                                              torch.zeros(70, dtype=torch.int32), visible, 0.125,
                                                              cpu_ops.current_attention_family()))
        outs, lses = zip(*parts)
        out, lse = cpu_ops.merge_attention_states(torch.stack(outs), torch.stack(lses))
        torch.testing.assert_close(out, want, **(TOL if dtype == torch.float32 else BF16_TOL))
        torch.testing.assert_close(lse, want_lse, **(TOL if dtype == torch.float32 else dict(atol=1e-3, rtol=1e-3)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernels_rows_over_a_share_equal_reference(dtype):
    """paged_attention_rows_lse, what a context-parallel rank runs: each row its sequence and its count of visible
    positions, in runs of one sequence (a prefill chunk's rows, which Triton's prefill kernel runs together) and
    single rows (decode), counts of 0 among them (output 0, lse -inf); each kernel against the reference, and
    the reference against attention over each row's positions."""
    q, k_cache, v_cache, tables, _, _ = paged_case([1, 1, 1], [150, 60, 33], 8, 2, 64, dtype=dtype, seed=11)
    g = torch.Generator().manual_seed(12)
    seqs = torch.tensor([0] * 40 + [2] + [1] * 20 + [0, 2, 2, 1], dtype=torch.int32)
    limits = torch.tensor([150, 60, 33])[seqs.long()]
    visible = (torch.rand(len(seqs), generator=g) * (limits + 1)).long().clamp(max=limits).to(torch.int32)
    visible[[3, 41, 50]] = 0
    queries = torch.randn(len(seqs), 8, 64, generator=g).to(dtype)
    want, want_lse = reference.paged_attention_rows_lse(queries, k_cache, v_cache, tables, seqs, visible, 0.125)
    bs = k_cache.shape[1]
    for t in (0, 5, 41, 63):  # the oracle itself: row t over its sequence's first visible[t] positions
        n, s = int(visible[t]), int(seqs[t])
        if n == 0:
            assert not want[t].any() and torch.isneginf(want_lse[t]).all()
            continue
        pos = torch.arange(n)
        k = k_cache[tables[s, pos // bs].long(), pos % bs]
        v = v_cache[tables[s, pos // bs].long(), pos % bs]
        out, lse = reference.attention_lse(queries[t:t + 1], k, v, torch.tensor([n]), pos, 0.125)
        torch.testing.assert_close(want[t:t + 1], out, **(TOL if dtype == torch.float32 else BF16_TOL))
    for impl in implementations(dtype):
        out, lse = impl.paged_attention_rows_lse(queries, k_cache, v_cache, tables, seqs, visible, 0.125)
        torch.testing.assert_close(out, want, **(TOL if dtype == torch.float32 else BF16_TOL))
        torch.testing.assert_close(lse, want_lse, **(TOL if dtype == torch.float32 else dict(atol=1e-3, rtol=1e-3)))
        single = torch.arange(3, dtype=torch.int32)  # every run one row: Triton's decode kernel
        out, lse = impl.paged_attention_rows_lse(queries[:3], k_cache, v_cache, tables, single, visible[:3], 0.125)
        want3, want3_lse = reference.paged_attention_rows_lse(queries[:3], k_cache, v_cache, tables, single,
                                                              visible[:3], 0.125)
        torch.testing.assert_close(out, want3, **(TOL if dtype == torch.float32 else BF16_TOL))
        torch.testing.assert_close(lse, want3_lse, **(TOL if dtype == torch.float32 else dict(atol=1e-3, rtol=1e-3)))
