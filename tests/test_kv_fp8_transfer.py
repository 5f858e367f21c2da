"""An fp8 KV cache's blocks outside the cache: the host and disk tiers store them as fp8 with their layers'
scales (a block read back under other scales is requantised; a stage whose scales are still to be calculated
takes the block's), PD transfer converts what a decode stage's cache holds otherwise, the wire's chunks are
checked, and over a TP=2 gloo group with decode context parallelism --calculate-kv-scales gives every rank the
same scales and the single rank's tokens."""
from __future__ import annotations

import json
import logging
import math

import pytest
import torch

from kernels import kv_quant
from parity import chained_logits, prompts
from stagemesh.core.errors import StagemeshError
from stage_worker import kv_transfer
from stage_worker.kv_scales import as_f32
from stage_worker.kv_tiers import KVTierStore, block_layout, kv_namespace, open_disk_tier
from stage_worker.runner import StageRunner
from test_tp_parity import run_tp

FP8 = torch.float8_e4m3fn


def fp8_runner(model_dir, **kw) -> StageRunner:
    r = StageRunner.of(model_dir, 0, 4, dtype="float32", kv_cache_dtype="fp8", **kw)
    r.allocate_kv_cache(8)
    return r


def fill(runner, seed: int, scales: list[tuple[float, float]] | None = None) -> list[torch.Tensor]:
    """Random fp8 contents (and, given, the layers' scales); a copy of every cache tensor."""
    g = torch.Generator().manual_seed(seed)
    for s, value in zip(runner.kv_scales.layers, scales or []):
        s.k, s.v = value
    for k, v in runner.kv_caches:
        for t in (k, v):
            t.copy_(kv_quant.quantize(torch.randn(t.shape, generator=g) * 50, 1.0, t.dtype))
    return [t.clone() for kv in runner.kv_caches for t in kv]


def block(runner, b: int) -> list[torch.Tensor]:
    return [t[b].view(torch.uint8).clone() for kv in runner.kv_caches for t in kv]


def bytes_of(tensors: list[torch.Tensor], b: int) -> list[torch.Tensor]:
    return [t[b].view(torch.uint8) for t in tensors]


def same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return tiny_model_dir("llama")


def test_host_and_disk_tiers_keep_fp8_blocks_and_their_scales(model, tmp_path):
    runner = fp8_runner(model)
    assert block_layout(runner)[-1] == ("float32", (4, 2)) and block_layout(runner)[0][0] == "float8_e4m3fn"
    assert kv_namespace(runner, 1)["kv_cache_dtype"] == "fp8_e4m3"
    assert "kv_cache_dtype" not in kv_namespace(StageRunner.of(model, 0, 4), 1)  # (the auto namespaces stay theirs)
    ns, disk = open_disk_tier(str(tmp_path), runner)
    tiers = KVTierStore(runner, disk)
    tiers.resize(2)
    scales = [(0.5, 0.25), (1.0, 2.0), (0.125, 4.0), (3.0, 0.75)]
    before = fill(runner, 0, scales)
    tiers.store([1, 2], [0, -1], [11, 22], [True, True], [])
    assert disk.flush()
    fill(runner, 1, scales)
    assert tiers.load([5, 6], [0, -1], [11, 22]) == [True, True]
    assert same(block(runner, 5), bytes_of(before, 1)) and same(block(runner, 6), bytes_of(before, 2))
    ns.close()

    later = fp8_runner(model)  # a restarted stage whose scales differ: the disk's block is requantised to them
    fill(later, 2, [(2 * k, v) for k, v in scales])
    ns2, disk2 = open_disk_tier(str(tmp_path), later)
    assert KVTierStore(later, disk2).load([3], [-1], [22]) == [True]
    for t, (got, was) in enumerate(zip([x[3] for kv in later.kv_caches for x in kv], [x[2] for x in before])):
        layer, kind = divmod(t, 2)
        old, new = scales[layer][kind], later.kv_scales.values()[layer][kind]
        assert torch.equal(got.view(torch.uint8), kv_quant.requantize(was, old, FP8, new).view(torch.uint8))
    ns2.close()

    pending = fp8_runner(model, calculate_kv_scales=True)  # scales still to be calculated: the block's are taken
    ns3, disk3 = open_disk_tier(str(tmp_path), pending)
    assert KVTierStore(pending, disk3).load([4], [-1], [22]) == [True]
    assert pending.kv_scales.source == "calculated" and pending.kv_scales.values() == scales
    assert same(block(pending, 4), bytes_of(before, 2))
    ns3.close()


def test_pd_transfer_converts_blocks_of_another_dtype_or_other_scales(model, caplog):
    caplog.set_level(logging.INFO, logger="stagemesh.stage")
    g = torch.Generator().manual_seed(4)
    shape = (2, 16, 2, 16)
    plain = [(torch.randn(shape, generator=g), torch.randn(shape, generator=g)) for _ in range(4)]
    theirs = [(as_f32(0.02), as_f32(0.03))] * 4
    sent = [tuple(kv_quant.quantize(x, s, FP8) for x, s in zip(kv, sc)) for kv, sc in zip(plain, theirs)]

    auto = StageRunner.of(model, 0, 4, dtype="float32")  # fp8 blocks into an fp32 cache: read as stored * scale
    got = kv_transfer.convert_layers(auto, sent, theirs)
    assert torch.equal(got[1][0], kv_quant.dequantize(sent[1][0], theirs[1][0], torch.float32))
    assert "the blocks came as torch.float8_e4m3fn (their scales); this stage's cache is torch.float32" in caplog.text

    mine = fp8_runner(model)
    for s in mine.kv_scales.layers:
        s.k, s.v = as_f32(0.04), theirs[0][1]
    got = kv_transfer.convert_layers(mine, sent, theirs)  # other key scales: requantised; the same value scales: kept
    assert got[0][1] is sent[0][1]
    assert torch.equal(got[0][0].float(), kv_quant.requantize(sent[0][0], theirs[0][0], FP8, as_f32(0.04)).float())
    got = kv_transfer.convert_layers(mine, plain, None)  # fp32 blocks into an fp8 cache: quantised with its scales
    assert torch.equal(got[2][1].float(), kv_quant.quantize(plain[2][1], theirs[2][1], FP8).float())

    pending = fp8_runner(model, calculate_kv_scales=True)
    assert kv_transfer.convert_layers(pending, sent, theirs)[3][0] is sent[3][0]  # the sender's scales taken
    assert pending.kv_scales.values() == theirs
    pending = fp8_runner(model, calculate_kv_scales=True)  # from an auto replica: calculated from these values
    kv_transfer.convert_layers(pending, plain, None)
    k_max = float(plain[0][0].abs().max())
    assert math.isclose(pending.kv_scales.values()[0][0], k_max / 200, rel_tol=1e-6)


def test_the_wire_checks_an_fp8_chunks_scales():
    from stage_worker.kv_connector import _bytes, _check_scales
    from stagemesh.v1 import stage_pb2

    seen: dict = {}
    ok = stage_pb2.KVBlocksChunk(layer=2, dtype="float8_e4m3fn", k_scale=0.5, v_scale=0.25)
    _check_scales("a:1", ok, FP8, seen)
    assert seen == {2: (0.5, 0.25)}
    for bad in (stage_pb2.KVBlocksChunk(layer=2, dtype="float8_e4m3fn", k_scale=0.5, v_scale=0.5),
                stage_pb2.KVBlocksChunk(layer=3, dtype="float8_e4m3fn", k_scale=-1.0, v_scale=0.5),
                stage_pb2.KVBlocksChunk(layer=4, dtype="float8_e4m3fn")):
        with pytest.raises(StagemeshError, match="sent fp8 KV of layer"):
            _check_scales("a:1", bad, FP8, seen)
    with pytest.raises(StagemeshError, match="sent a float32 KV chunk with fp8 scales"):
        _check_scales("a:1", stage_pb2.KVBlocksChunk(layer=2, dtype="float32", k_scale=1.0), torch.float32, {})
    x = kv_quant.quantize(torch.randn(3, 4), 0.01, FP8)
    back = torch.frombuffer(bytearray(_bytes(x)), dtype=torch.uint8).view(FP8).view(3, 4)
    assert torch.equal(back.float(), x.float())


@pytest.mark.slow
def test_tp2_dcp2_reads_the_fp8_cache_as_one_rank_and_agrees_on_calculated_scales(tiny_model_dir, tmp_path):
    """Decode context parallelism over 2 gloo ranks (each keeps half of every block's tokens, every KV head): over
    an fp8 cache it gives one rank's tokens and logits; with --calculate-kv-scales both ranks take the maxima over
    the two, the same scales, those of one rank computing the whole step (to fp32 rounding: the layers after the
    first see the merged attention's rounding, and the largest key lands on an fp8 tie by construction, max / 200
    = 200 between 192 and 208, so the logits are compared where the scales are given)."""
    model_dir = tiny_model_dir("llama", hidden_size=256, num_attention_heads=4, num_key_value_heads=2)
    prompt = prompts(384, lengths=(37,))[0]
    want_tokens, want_logits = chained_logits(model_dir, [4], prompt, 8, kv_cache_dtype="fp8")
    got = run_tp(model_dir, 2, "4", prompt, 8, tmp_path, False, "--dcp", "2", "--kv-cache-dtype", "fp8")
    assert got["tokens"] == want_tokens
    torch.testing.assert_close(torch.tensor(got["logits"]), want_logits, atol=1e-4, rtol=1e-4)

    scales: list = []
    want_tokens, _ = chained_logits(model_dir, [4], prompt, 8, kv_cache_dtype="fp8", calculate_kv_scales=True,
                                    kv_scales_out=scales)
    got = run_tp(model_dir, 2, "4", prompt, 8, tmp_path, False, "--dcp", "2", "--kv-cache-dtype", "fp8",
                 "--calculate-kv-scales")
    assert got["tokens"] == want_tokens
    ranks = [json.loads((tmp_path / f"result.json.scales{r}").read_text()) for r in range(2)]
    assert ranks[0] == ranks[1] and ranks[0][0] == list(scales[0][0])  # the first layer's: the same keys exactly
    torch.testing.assert_close(torch.tensor(ranks[0]), torch.tensor(scales[0]), atol=0, rtol=1e-5)
