"""A stage's oneDNN products run on a bounded set of row counts (issue 43, item 17: stage RSS grew ~8 MiB/min
under a mixed soak).

oneDNN keeps what it builds for each row count a packed product meets (~0.4-1 MiB: JIT kernels, descriptors)
in caches of 1,024 entries; a serving stage meets a new count in most steps. The products now run on 48 row
counts per weight (stage_worker.layers.onednn_linear; kernels/csrc/decoder_layer.cpp the same), so once a
stage has met them, steps of any other token count add nothing; and a stage builds them all as it packs its
weights (stage_worker.layers.warm_onednn), so its first steps add nothing either.

The memory checks run in a fresh interpreter with both caches made large enough never to evict (eviction
would hide the growth a 1,024-entry cache only bounds at ~1 GB): a first round of steps of 1..256 tokens, then
a round of 257..500 tokens (every third count, for the engine), whose growth (RSS, after malloc_trim) must
stay near zero.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels import cpu_ops
from stage_worker import layers
from stagemesh.core.common_flags import SKIP_WARMUP_ENV

ROOT = Path(__file__).resolve().parent.parent

GROWTH = r"""
import ctypes, sys
import psutil, torch
torch.set_num_threads(1)
mode, model_dir = sys.argv[1], sys.argv[2]
libc = ctypes.CDLL("libc.so.6")

def rss():
    libc.malloc_trim(0)
    return psutil.Process().memory_info().rss / 2**20

if mode == "engine":  # the stage's runner (the C++ layer plans, the LM head's Python product)
    from stagemesh.core.sampling_params import SamplingParams
    from stagemesh.entry.local_engine import LocalEngine
    engine = LocalEngine.of(model_dir, max_num_batched_tokens=512, enable_prefix_caching=False)
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    # the last stage makes its grammar compiler (xgrammar, the tokenizer: ~70 MiB) in its compile thread as it
    # starts: waited for here, since it is not what this measures
    engine.runners[-1].sampler._thread().submit(lambda: None).result(timeout=120)
    def step(n):  # one prefill step of n tokens
        engine.generate([[3 + (i * 7) % 300 for i in range(n)]], params)
else:  # one packed product, through the Python layer's call or the layer plan's
    from stage_worker import layers
    w = torch.ops.mkldnn._reorder_linear_weight(torch.randn(128, 64), layers._PACK_ROWS_HINT)
    x = torch.randn(512, 64)
    if mode == "plan":
        from kernels import cpu_ops
        linear = cpu_ops.load().LayerLinear("mkldnn", w)
        step = lambda n: linear(x[:n])
    else:
        step = lambda n: layers._matmul(x[:n], w)
start = rss()
for n in range(1, 257):
    step(n)
before = rss()
for n in range(257, 501, int(sys.argv[3])):
    step(n)
print(f"{before - start:.1f} {rss() - before:.1f}")
"""


def growth_mib(mode: str, model_dir: Path | str = "", every: int = 1) -> tuple[float, float]:
    """RSS growth (MiB) of the first and the second round of steps (every `every`-th token count of the second),
    in a fresh interpreter."""
    env = {**os.environ, "LRU_CACHE_CAPACITY": "100000", "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "100000",
           "OMP_NUM_THREADS": "1", SKIP_WARMUP_ENV: "0"}  # (the stage's oneDNN builds at load, as it serves)
    out = subprocess.run([sys.executable, "-c", GROWTH, mode, str(model_dir), str(every)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    first, second = out.stdout.strip().splitlines()[-1].split()
    return float(first), float(second)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this torch")
def test_a_stage_s_memory_stops_growing_with_new_token_counts(tiny_model_dir):
    first, second = growth_mib("engine", tiny_model_dir("llama"), every=3)
    # before the fix: 180-540 MiB more (each of 82 new token counts adds oneDNN products for every weight shape);
    # the bounds leave room for a loaded machine's noise (23 MiB seen once under load)
    assert second < 40, second
    # the products of every row count were built as the weights were packed (warm_onednn); without: ~113 MiB
    assert first < 40, first


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this torch")
@pytest.mark.parametrize("path", ["python", "plan"])
def test_a_packed_product_meets_a_bounded_set_of_row_counts(path):
    if path == "plan" and cpu_ops.load() is None:
        pytest.skip("the C++ kernels are not built here")
    assert growth_mib(path)[1] < 8  # before the fix: ~100 MiB


def test_row_counts_are_bounded_and_padding_is_small():
    sizes = {layers.onednn_rows(n) for n in range(1, layers.ONEDNN_PIECE_ROWS + 1)}
    assert len(sizes) == 48 and max(sizes) == layers.ONEDNN_PIECE_ROWS
    for n in range(1, layers.ONEDNN_PIECE_ROWS + 1):
        padded = layers.onednn_rows(n)
        assert n <= padded < n * 1.125 + 1 and (n > layers.ONEDNN_EXACT_ROWS or padded == n)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this torch")
def test_pieces_and_padding_give_the_unpadded_product_s_bits():
    torch.manual_seed(0)
    w = torch.ops.mkldnn._reorder_linear_weight(torch.randn(96, 64), layers._PACK_ROWS_HINT)
    bias, x = torch.randn(96), torch.randn(700, 64)
    plan = cpu_ops.load().LayerLinear("mkldnn", w, bias=bias) if cpu_ops.load() is not None else None
    for n in (1, 16, 17, 31, 100, 255, 256, 257, 300, 513, 700):
        want = torch.ops.mkldnn._linear_pointwise(x[:n], w, bias, "none", [], "")
        assert torch.equal(layers.onednn_linear(x[:n], w, bias), want), n
        if plan is not None:
            assert torch.equal(plan(x[:n]), want), n
    x3 = x[:120].reshape(2, 60, 64)  # leading dimensions are kept
    assert torch.equal(layers.onednn_linear(x3, w, bias), torch.ops.mkldnn._linear_pointwise(x3, w, bias, "none", [],
                                                                                               ""))
