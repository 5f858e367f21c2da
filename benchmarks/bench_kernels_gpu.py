"""Paged-attention decode on a GPU: Triton kernel vs the torch reference, as achieved
memory bandwidth and as a fraction of the GPU's measured device-to-device copy bandwidth.

Llama-3.1-8B head shape (32 query heads, 8 KV heads, head_dim 128), bf16, block size 16,
batch 64, context 4096.   python benchmarks/bench_kernels_gpu.py

Context parallelism's kernels (docs/context-parallelism.md) after it: the same decode with its log-sum-exp
(paged_attention_lse, what a DCP / PCP rank runs over its share), and the merge of 2 and 4 ranks' partials
(merge_attention_states), Triton against the torch reference, each checked against the reference first.
"""
from __future__ import annotations

import argparse

import torch
import triton.testing

from kernels import reference, triton_attention, triton_ops


def copy_bandwidth() -> float:
    """Bytes read + written per second by a large device-to-device copy."""
    src = torch.empty(2 * 2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=10, rep=100)
    return 2 * src.numel() / (ms / 1e3)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--block-size", type=int, default=16)
    a = p.parse_args()
    heads, kv_heads, d, bs = 32, 8, 128, a.block_size
    blocks_per_seq = a.context // bs
    num_blocks = a.batch * blocks_per_seq
    g = torch.Generator(device="cuda").manual_seed(0)
    k_cache = torch.randn(num_blocks, bs, kv_heads, d, device="cuda", dtype=torch.bfloat16, generator=g)
    v_cache = torch.randn(num_blocks, bs, kv_heads, d, device="cuda", dtype=torch.bfloat16, generator=g)
    tables = torch.randperm(num_blocks, device="cuda", generator=g).view(a.batch, blocks_per_seq).int()
    q = torch.randn(a.batch, heads, d, device="cuda", dtype=torch.bfloat16, generator=g)
    ctx = torch.full((a.batch,), a.context, dtype=torch.int32, device="cuda")
    qsl = torch.arange(a.batch + 1, dtype=torch.int32, device="cuda")
    args = (q, k_cache, v_cache, tables, ctx, qsl, d ** -0.5)
    torch.testing.assert_close(triton_ops.paged_attention(*args), reference.paged_attention(*args), atol=2e-2,
                               rtol=2e-2)
    kv_bytes = 2 * a.batch * a.context * kv_heads * d * 2
    bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: device-to-device copy {bw / 1e12:.2f} TB/s (read + write)")
    print(f"paged-attention decode, batch {a.batch}, context {a.context}, 32/8 heads, head_dim 128, bf16, "
          f"block {bs}: {kv_bytes / 1e9:.2f} GB of KV per call")
    for name, fn in (("triton", triton_ops.paged_attention), ("torch reference", reference.paged_attention)):
        ms = triton.testing.do_bench(lambda: fn(*args), warmup=10, rep=100)
        achieved = kv_bytes / (ms / 1e3)
        print(f"  {name:16s} {ms:8.3f} ms  {achieved / 1e12:6.2f} TB/s  = {achieved / bw:5.2f} of copy bandwidth")
    context_parallel(args, kv_bytes, bw)


def context_parallel(args: tuple, kv_bytes: int, bw: float) -> None:
    out, lse = triton_attention.paged_attention_lse(*args)
    want, want_lse = reference.paged_attention_lse(*args)
    torch.testing.assert_close(out, want, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, want_lse, atol=2e-2, rtol=2e-2)
    ms = triton.testing.do_bench(lambda: triton_attention.paged_attention_lse(*args), warmup=10, rep=100)
    print(f"  {'triton with lse':16s} {ms:8.3f} ms  {kv_bytes / (ms / 1e3) / 1e12:6.2f} TB/s  = "
          f"{kv_bytes / (ms / 1e3) / bw:5.2f} of copy bandwidth")
    q = args[0]
    for ranks in (2, 4):
        outs = torch.randn(ranks, *q.shape, device="cuda", dtype=q.dtype)
        lses = torch.randn(ranks, *q.shape[:2], device="cuda", dtype=torch.float32) * 4
        got, got_lse = triton_attention.merge_attention_states(outs, lses)
        ref, ref_lse = reference.merge_attention_states(outs, lses)
        torch.testing.assert_close(got, ref, atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(got_lse, ref_lse, atol=1e-4, rtol=1e-4)
        moved = outs.numel() * outs.element_size() + lses.numel() * 4 + got.numel() * got.element_size()
        for name, fn in (("triton", triton_attention.merge_attention_states),
                         ("torch reference", reference.merge_attention_states)):
            ms = triton.testing.do_bench(lambda: fn(outs, lses), warmup=10, rep=100)
            print(f"  merge of {ranks} partials ({name}): {ms * 1e3:8.1f} us  {moved / (ms / 1e3) / 1e9:7.1f} GB/s")


if __name__ == "__main__":
    main()
