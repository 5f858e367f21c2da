"""KV tiers through the real services (docs/kv-tiers.md): a prefix evicted from a small KV pool comes back
from the host tier, and after a restart of every process from the disk tier, with transformers' greedy
tokens and its prompt counted as cached; a corrupt file, or another model's directory, is computed instead.
PP=2, TP=2, TP=2 with decode context parallelism (each rank stores and loads its share of every block's tokens)
and a MoE model."""
from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
import requests

from mesh import Mesh, free_port
from parity import prompts
from stagemesh.core.sampling_params import SamplingParams
from tiny_models import reference_model, reference_tokens

NEW_TOKENS = 8
POOL_BYTES = "90112"  # 11 blocks of 16 tokens per stage of 2 layers (tests/test_mesh_parity.py)
PROMPT_LEN, FILLER_LEN = 70, 100  # the prompt's 4 full blocks (a token is always left to compute)
HIT = (PROMPT_LEN - 1) // 16 * 16

LAYOUTS = {
    "pp2": dict(split=[2, 2], tp=[1, 1], handoff="grpc"),
    "tp2": dict(split=[4], tp=[2], handoff="nccl"),  # 4 layers, the KV heads over 2 ranks: 11 blocks too
    # -dcp 2: both ranks hold both KV heads and 8 of each block's 16 tokens (stage_worker.context), 11 blocks too;
    # each rank's tiers keep its own share (its host slots, its disk namespace's rank directory)
    "tp2-dcp2": dict(split=[4], tp=[2], handoff="nccl", extra_stage_args=("--decode-context-parallel-size", "2")),
}


def tier_counters(port: int) -> dict[tuple[str, str], float]:
    """{(counter, tier): value} of the scheduler's stagemesh:kv_tier_* counters."""
    out = {}
    for line in requests.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text.splitlines():
        m = re.match(r'stagemesh:kv_tier_(\w+)_total\{tier="(\w+)"\} ([0-9.e+]+)$', line)
        if m:
            out[m.group(1), m.group(2)] = float(m.group(3))
    return out


def tiered_mesh(model_dir, tmp_path: Path, disk: Path, layout: dict, name: str) -> tuple[Mesh, int]:
    """(the mesh, its scheduler's metrics port); stage 0's metrics port is mesh.stage_metrics_port."""
    port, stage_port = free_port(), free_port()
    layout = dict(layout)
    pool = layout.pop("pool", POOL_BYTES)
    extra = tuple(layout.pop("extra_stage_args", ()))
    log_dir = tmp_path / name
    log_dir.mkdir()
    mesh = Mesh(model_dir, log_dir=log_dir, **layout,
                scheduler_args=("--kv-offloading-size", "0.001", "--kv-offloading-disk-size", "0.01",
                                "--metrics-port", str(port)),
                stage_args=("--kv-cache-memory", pool, "--kv-offloading-disk-path", str(disk), *extra),
                per_stage_args={0: ["--metrics-port", str(stage_port)]})
    mesh.stage_metrics_port = stage_port
    return mesh, port


def ask(mesh: Mesh, request_id: str, prompt: list[int]) -> tuple[list[int], int]:
    tokens, _ = mesh.submit(request_id, prompt, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
    return tokens, mesh.cached_tokens[request_id]


def wait_for_files(disk: Path, count: int, timeout: float = 30) -> None:
    """The disk tier writes in the background: wait until it wrote `count` block files."""
    deadline = time.monotonic() + timeout
    while len(list(disk.rglob("*.kv"))) < count:
        assert time.monotonic() < deadline, f"the disk tier wrote {len(list(disk.rglob('*.kv')))} of {count} files"
        time.sleep(0.2)


def run_tiers(model_dir, tmp_path: Path, layout: dict, check_disk: bool = True) -> None:
    ref = reference_model(model_dir)
    prompt, *fillers = prompts(384, (PROMPT_LEN, FILLER_LEN, FILLER_LEN, FILLER_LEN), seed=44)
    want = reference_tokens(ref, prompt, NEW_TOKENS)
    disk = tmp_path / "kv-disk"
    mesh, port = tiered_mesh(model_dir, tmp_path, disk, layout, "first")
    with mesh:
        assert ask(mesh, "cold", prompt) == (want, 0)
        for i, filler in enumerate(fillers):  # the pool's 11 blocks go to other prompts
            ask(mesh, f"filler{i}", filler)
        assert ask(mesh, "from-host", prompt) == (want, HIT)
        counters = tier_counters(port)
        assert counters.get(("loaded_blocks", "host")) == HIT // 16 and not counters.get(("failed_loads", "host"))
        stages = len(layout["split"])
        wait_for_files(disk, stages * max(layout["tp"]) * (HIT // 16 + 3 * (FILLER_LEN - 1) // 16))
    if not check_disk:
        return
    mesh, port = tiered_mesh(model_dir, tmp_path, disk, layout, "restarted")
    with mesh:  # every process new, on the same directories: the prefix is on disk
        assert ask(mesh, "from-disk", prompt) == (want, HIT)
        assert tier_counters(port).get(("loaded_blocks", "disk")) == HIT // 16
    for path in disk.rglob("*.kv"):  # every block file damaged: each is a miss, never wrong tokens
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))
    mesh, port = tiered_mesh(model_dir, tmp_path, disk, layout, "corrupt")
    with mesh:
        assert ask(mesh, "corrupt", prompt) == (want, 0)
        assert tier_counters(port).get(("failed_loads", "disk")) == HIT // 16
        stage0 = requests.get(f"http://127.0.0.1:{mesh.stage_metrics_port}/metrics", timeout=10).text
        assert f'stagemesh:stage_kv_disk_blocks_total{{event="read_misses",stage="0"}} {HIT // 16}.0' in stage0
    logs = "".join(p.read_text() for p in (tmp_path / "corrupt").glob("stage*.log"))
    assert "checksum" in logs or "corrupt" in logs


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_prefix_comes_back_from_host_and_from_disk_after_a_restart_token_exact(tiny_model_dir, tmp_path, layout):
    run_tiers(tiny_model_dir("llama"), tmp_path, LAYOUTS[layout])


@pytest.mark.slow
def test_a_moe_model_loads_its_prefix_back_from_the_host_tier(tiny_model_dir, tmp_path):
    run_tiers(tiny_model_dir("qwen2_moe"), tmp_path, dict(split=[2, 2], tp=[1, 1], handoff="grpc"), check_disk=False)


@pytest.mark.slow
def test_another_model_on_the_same_directory_reads_none_of_its_blocks(tiny_model_dir, tmp_path):
    # the same architecture and shapes, other weights: only the weights' fingerprint tells them apart
    llama, other = tiny_model_dir("llama"), tiny_model_dir("llama", seed=1)
    prompt = prompts(384, (PROMPT_LEN,), seed=44)[0]
    disk = tmp_path / "kv-disk"
    layout = dict(split=[2, 2], tp=[1, 1], handoff="grpc")
    mesh, _ = tiered_mesh(llama, tmp_path, disk, layout, "llama")
    with mesh:
        ask(mesh, "llama", prompt)
        wait_for_files(disk, 2 * HIT // 16)
    want = reference_tokens(reference_model(other), prompt, NEW_TOKENS)
    mesh, port = tiered_mesh(other, tmp_path, disk, layout, "other")
    with mesh:
        assert ask(mesh, "other", prompt) == (want, 0)
        counters = tier_counters(port)
        assert not counters.get(("loaded_blocks", "disk")) and not counters.get(("failed_loads", "disk"))
