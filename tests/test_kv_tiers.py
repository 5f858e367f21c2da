"""The KV tiers of one rank (stage_worker.kv_tiers, stage_worker.kv_disk) on a real StageRunner of a tiny model:
store and load round-trip the cache's bytes exactly through host memory and disk; a corrupt, truncated or
foreign file is a logged miss; a restarted store lists what it wrote; a second holder of a namespace directory,
an unwritable directory and a full disk are handled as documented."""
from __future__ import annotations

import logging
import os
import shutil
import subprocess
import time
import uuid
from pathlib import Path

import pytest
import torch

from stagemesh.core.errors import StagemeshError
from stage_worker.kv_disk import NamespaceDir, check_writable, model_fingerprint
from stage_worker.kv_tiers import KVTierStore, kv_namespace, open_disk_tier
from stage_worker.runner import StageRunner

NUM_BLOCKS = 8


@pytest.fixture(scope="module")
def runner(tiny_model_dir):
    r = StageRunner.of(tiny_model_dir("llama"), 0, 4)
    r.allocate_kv_cache(NUM_BLOCKS)
    return r


def randomize(runner, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    for k, v in runner.kv_caches:
        k.copy_(torch.randn(k.shape, generator=g))
        v.copy_(torch.randn(v.shape, generator=g))
    return [t.clone() for kv in runner.kv_caches for t in kv]


def block(runner, b: int) -> list[torch.Tensor]:
    return [t[b].clone() for kv in runner.kv_caches for t in kv]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


def test_host_tier_round_trips_blocks_exactly_and_refuses_another_hash(runner):
    tiers = KVTierStore(runner)
    tiers.resize(4)
    before = randomize(runner)
    tiers.store([1, 2], [0, 3], [11, 22], [False, False], [])
    randomize(runner, seed=1)  # the cache moves on
    untouched = block(runner, 7)
    assert tiers.load([5, 6, 7], [0, 3, 3], [11, 22, 99]) == [True, True, False]
    assert same(block(runner, 5), [t[1] for t in before]) and same(block(runner, 6), [t[2] for t in before])
    assert same(block(runner, 7), untouched)  # another hash: the block is not written
    assert tiers.load([0], [1], [11]) == [False]  # an empty slot
    tiers.resize(4)  # the same size at the next join: what it holds stays
    assert tiers.load([0], [0], [11]) == [True]


def test_a_host_tier_larger_than_the_host_is_refused_by_name(runner):
    with pytest.raises(StagemeshError, match="--kv-offloading-size"):
        KVTierStore(runner).resize(1 << 40)


def test_disk_tier_round_trips_and_a_restarted_store_lists_what_it_wrote(runner, tmp_path):
    ns, disk = open_disk_tier(str(tmp_path), runner)
    tiers = KVTierStore(runner, disk)
    tiers.resize(0)
    before = randomize(runner)
    tiers.store([1, 2, 4], [-1, -1, -1], [11, 22, 44], [True, True, True], [])
    assert disk.flush()
    tiers.store([], [], [], [], [44])  # evicted by the scheduler: its file goes
    assert disk.flush()
    assert sorted(tiers.disk_hashes()) == [11, 22]
    assert (ns.path / "namespace.json").is_file()
    tiers.close()
    ns.close()

    randomize(runner, seed=3)
    ns2, disk2 = open_disk_tier(str(tmp_path), runner)  # a restart on the same directory
    again = KVTierStore(runner, disk2)
    assert ns2.path == ns.path and sorted(again.disk_hashes()) == [11, 22]
    assert sorted(ns2.common_hashes(1)) == [11, 22]
    assert again.load([6, 7, 5], [-1, -1, -1], [22, 11, 44]) == [True, True, False]
    assert same(block(runner, 6), [t[2] for t in before]) and same(block(runner, 7), [t[1] for t in before])
    ns2.close()


@pytest.fixture
def written(runner, tmp_path):
    ns, disk = open_disk_tier(str(tmp_path / "kv"), runner)
    tiers = KVTierStore(runner, disk)
    randomize(runner)
    tiers.store([1], [-1], [0xABC], [True], [])
    assert disk.flush()
    yield tiers, disk.file_of(0xABC)
    ns.close()


def _load_misses(runner, tiers, caplog, reason: str, path: Path) -> None:
    sentinel = randomize(runner, seed=9)
    with caplog.at_level(logging.WARNING, logger="stagemesh.stage"):
        assert tiers.load([5], [-1], [0xABC]) == [False]
    assert same(block(runner, 5), [t[5] for t in sentinel])  # never anything but verified KV in a block
    assert any(str(path) in r.getMessage() and reason in r.getMessage() for r in caplog.records), caplog.text


def test_a_corrupt_file_is_a_logged_miss(runner, written, caplog):
    tiers, path = written
    data = bytearray(path.read_bytes())
    data[-100] ^= 0x01  # a flipped bit in the payload
    path.write_bytes(data)
    _load_misses(runner, tiers, caplog, "checksum", path)


def test_a_truncated_file_is_a_logged_miss(runner, written, caplog):
    tiers, path = written
    path.write_bytes(path.read_bytes()[:-10])
    _load_misses(runner, tiers, caplog, "truncated", path)


def test_a_missing_file_is_a_logged_miss(runner, written, caplog):
    tiers, path = written
    path.unlink()
    _load_misses(runner, tiers, caplog, "No such file", path)


def test_a_foreign_models_file_is_never_loaded(runner, written, tiny_model_dir, tmp_path, caplog):
    tiers, path = written
    other = StageRunner.of(tiny_model_dir("llama", rms_norm_eps=1e-5), 0, 4)  # same shapes, another model
    other.allocate_kv_cache(NUM_BLOCKS)
    ns, disk = open_disk_tier(str(tmp_path / "other"), other)
    assert ns.namespace != tiers.disk.namespace
    KVTierStore(other, disk).store([1], [-1], [0xABC], [True], [])
    assert disk.flush()
    shutil.copy(disk.file_of(0xABC), path)  # under the right name, in this model's directory
    _load_misses(runner, tiers, caplog, "another model", path)
    ns.close()


def test_the_namespace_changes_with_the_weights_and_the_layout(runner, tiny_model_dir, tmp_path):
    src = Path(tiny_model_dir("llama"))
    copy = tmp_path / "copy"
    shutil.copytree(src, copy)
    start = time.perf_counter()
    assert model_fingerprint(copy) == model_fingerprint(src)
    assert time.perf_counter() - start < 1
    weights = next(copy.glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF
    weights.write_bytes(data)
    assert model_fingerprint(copy) != model_fingerprint(src)
    assert kv_namespace(runner, 1) != kv_namespace(runner, 2)


def test_a_second_holder_of_a_namespace_directory_is_refused(runner, tmp_path):
    description = kv_namespace(runner, 1)
    first = NamespaceDir(tmp_path, description, 1)
    with pytest.raises(StagemeshError, match="in use by another stage.*replica"):
        NamespaceDir(tmp_path, description, 1)
    first.close()
    NamespaceDir(tmp_path, description, 1).close()  # free once the first let go


def test_leftover_temporary_files_are_removed_at_start(runner, tmp_path):
    ns = NamespaceDir(tmp_path, kv_namespace(runner, 1), 1)
    tmp = ns.path / "rank0" / ".0000000000000abc.kv.tmp123"
    tmp.write_bytes(b"half")
    ns.close()
    NamespaceDir(tmp_path, kv_namespace(runner, 1), 1).close()
    assert not tmp.exists()


def test_an_unwritable_directory_is_refused_with_its_path(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(StagemeshError, match=f"{blocker}/kv"):
        check_writable(blocker / "kv")
    if os.geteuid() != 0:  # root writes anywhere
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
        with pytest.raises(StagemeshError, match=str(ro)):
            check_writable(ro)


@pytest.fixture
def small_fs(tmp_path):
    """A 64 KiB tmpfs (root, or a user namespace that allows mounts); skipped where neither is possible."""
    path = tmp_path / f"full-{uuid.uuid4().hex[:6]}"
    path.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(path)],
                                           capture_output=True).returncode != 0:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def test_a_full_disk_goes_on_without_the_tier_with_one_warning(runner, small_fs, caplog):
    ns, disk = open_disk_tier(str(small_fs), runner)
    disk.full_pause_s = 0.5
    tiers = KVTierStore(runner, disk)
    tiers.resize(2)
    randomize(runner)
    with caplog.at_level(logging.WARNING, logger="stagemesh.stage"):
        for i in range(8):  # 16 KiB blocks: a few fit
            tiers.store([i % NUM_BLOCKS], [0], [100 + i], [True], [])
            assert disk.flush()
        time.sleep(0.6)
        for i in range(8, 12):  # full again after the pause: no second warning
            tiers.store([0], [0], [100 + i], [True], [])
            assert disk.flush()
    full = [r for r in caplog.records if "is full" in r.getMessage()]
    assert len(full) == 1 and disk.stats.full_pauses >= 2, caplog.text
    on_disk = disk.hashes()
    assert 0 < len(on_disk) < 8
    assert tiers.load([5, 6], [-1, 0], [on_disk[0], 111]) == [True, True]  # reads and the host tier go on
    tiers.store([], [], [], [], on_disk)  # room again: writes resume after the pause
    assert disk.flush()
    time.sleep(0.6)
    tiers.store([1], [1], [500], [True], [])
    assert disk.flush() and disk.hashes() == [500]
    ns.close()


def test_serve_gives_each_replica_a_disk_tier_directory_of_its_own(tmp_path):
    import argparse

    from stagemesh.entry import serve
    from stagemesh.entry.layout import plan_commands

    p = argparse.ArgumentParser()
    serve.add_arguments(p)
    args = p.parse_args(["-dp", "2", "-pp", "2", "--kv-offloading-disk-path", str(tmp_path)])
    paths = {s.name: dict(zip(s.argv, s.argv[1:])).get("--kv-offloading-disk-path")
             for s in plan_commands(args, "/m", 4, cuda=False)}
    assert paths["stage[0.0]"] == paths["stage[0.1]"] == str(tmp_path / "replica-0")
    assert paths["stage[1.0]"] == paths["stage[1.1]"] == str(tmp_path / "replica-1")
    assert paths["scheduler[0]"] is None and paths["router"] is None


def test_the_in_process_pipeline_stores_and_loads_over_its_stages(tiny_model_dir, tmp_path):
    import asyncio
    from types import SimpleNamespace

    from stagemesh.entry.inprocess_pipeline import InProcessPipeline

    model = tiny_model_dir("llama")
    runners = [StageRunner.of(model, 0, 2), StageRunner.of(model, 2, 4)]
    pipeline = InProcessPipeline(runners, NUM_BLOCKS, kv_disk_path=str(tmp_path))
    assert pipeline.has_disk_tier and pipeline.kv_bytes_per_block == sum(r.kv_bytes_per_block for r in runners)
    plan = SimpleNamespace(num_kv_blocks=NUM_BLOCKS, num_host_kv_blocks=2)
    loop = asyncio.new_event_loop()
    loop.run_until_complete(pipeline.join(1, plan, 64, 64))
    before = [randomize(r, seed=i) for i, r in enumerate(runners)]
    loop.run_until_complete(pipeline.store_kv(1, [1, 2], [0, -1], [7, 8], [False, True], []))
    for t in pipeline.tiers:
        assert t.disk.flush()
    # stage 1 lost its file: block 8 loads on neither stage
    pipeline.tiers[1].disk.file_of(8).unlink()
    assert loop.run_until_complete(pipeline.load_kv(1, [5, 6], [0, -1], [7, 8])) == [True, False]
    assert all(same(block(r, 5), [t[1] for t in b]) for r, b in zip(runners, before))
    loop.run_until_complete(pipeline.store_kv(1, [3], [-1], [9], [True], []))
    for t in pipeline.tiers:
        assert t.disk.flush()
    loop.run_until_complete(pipeline.join(2, plan, 64, 64))
    assert pipeline.disk_block_hashes == [9]  # what every stage holds
    loop.close()


def test_a_draft_models_kv_travels_with_its_blocks(tiny_model_dir, tmp_path):
    from stagemesh.core.speculative import parse_speculative_config
    from stage_worker.draft import DraftModel

    model = tiny_model_dir("llama")
    r = StageRunner.of(model, 0, 4)
    r.attach_drafter(DraftModel(parse_speculative_config({"model": str(tiny_model_dir("llama", num_hidden_layers=2)),
                                                          "num_speculative_tokens": 2}), r.config, "cpu", None, 16))
    r.allocate_kv_cache(NUM_BLOCKS)
    ns, disk = open_disk_tier(str(tmp_path), r)
    tiers = KVTierStore(r, disk)
    assert tiers.bytes_per_block == r.kv_bytes_per_block and len(tiers.caches()) == 2 * (4 + 2)
    tiers.resize(1)
    g = torch.Generator().manual_seed(0)
    for t in tiers.caches():
        t.copy_(torch.randn(t.shape, generator=g))
    before = [t[2].clone() for t in tiers.caches()]
    tiers.store([2], [0], [5], [True], [])
    assert disk.flush()
    assert tiers.load([3, 4], [0, -1], [5, 5]) == [True, True]
    assert all(torch.equal(t[3], b) and torch.equal(t[4], b) for t, b in zip(tiers.caches(), before))
    ns.close()


def test_the_stages_metrics_count_what_its_tiers_did(runner, written, caplog):
    from stage_worker.kv_tier_metrics import KVTierCollector

    tiers, path = written
    data = bytearray(path.read_bytes())
    data[-100] ^= 0x01  # one bad file: a read miss
    path.write_bytes(data)
    assert tiers.load([6], [-1], [0xABC]) == [False]
    samples = {(s.name, s.labels["event"]): s.value for family in KVTierCollector(3, tiers).collect()
               for s in family.samples}
    assert samples[("stagemesh:stage_kv_tier_blocks_total", "refused")] == 1
    assert samples[("stagemesh:stage_kv_disk_blocks_total", "read_misses")] == 1
    assert samples[("stagemesh:stage_kv_disk_blocks_total", "written")] >= 1
