"""benchmarks/gpu_check.py (issue 45): its roofline arithmetic against figures worked out by hand, its model
directory against transformers and stagemesh, and its CPU dry run end to end (serve + in-process)."""
from __future__ import annotations

import importlib.util
import math
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"
_spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
gpu_check = importlib.util.module_from_spec(_spec)
sys.modules["gpu_check"] = gpu_check  # (its dataclasses look their module up)
_spec.loader.exec_module(gpu_check)


def test_parameter_counts_are_the_real_models():
    # Llama-3.2-1B: 1,235,814,400 parameters (tied); Llama-3.1-8B: 8,030,261,248
    for shape, params in (("1b", 1_235_814_400), ("8b", 8_030_261_248)):
        cfg = gpu_check.hf_config(shape, "bfloat16")
        assert sum(math.prod(d) for _, d in gpu_check.tensor_shapes(cfg)) == params


def test_roofline_against_hand_computed_figures():
    cfg = gpu_check.hf_config("1b", "bfloat16")
    # a 1B layer: q 2048*2048 + k, v 2048*512 each + o 2048*2048 + 3 * 2048*8192 + two norms of 2048 = 60,821,504;
    # 16 layers + final norm 2048 + LM head (the tied embeddings) 128256*2048 + one embedding row 2048
    # = 1,235,816,448 parameters read, 2 bytes each
    assert gpu_check.weight_bytes_per_token(cfg) == 2_471_632_896
    # K and V, 16 layers, 8 KV heads of 64, bf16: 32,768 bytes a position
    assert gpu_check.kv_bytes_per_position(cfg) == 32_768
    # 128-token prompt, 256 new tokens: the steps making tokens 2..256 attend over 129..383 positions, mean 256
    assert gpu_check.mean_decode_context(128, 256) == 256
    # (2,471,632,896 + 256 * 32,768) bytes / 3.35e12 bytes/s = 0.74030 ms
    assert gpu_check.roofline_tpot_s(cfg, 128, 256, 3350.0) == pytest.approx(0.74030e-3, rel=1e-5)
    # 8B: 15,009,857,536 weight bytes (RESULTS.md's "15.0 GB read per step"), 131,072 KV bytes a position
    cfg8 = gpu_check.hf_config("8b", "bfloat16")
    assert gpu_check.weight_bytes_per_token(cfg8) == 15_009_857_536
    assert gpu_check.roofline_tpot_s(cfg8, 128, 256, 4800.0) == pytest.approx(
        (15_009_857_536 + 256 * 131_072) / 4.8e12)


def test_peak_bandwidth_from_the_device_name():
    assert gpu_check.hbm_peak("NVIDIA H100 80GB HBM3")[0] == 3350.0  # SXM
    assert gpu_check.hbm_peak("NVIDIA H100 PCIe")[0] == 2000.0
    assert gpu_check.hbm_peak("NVIDIA H100 NVL")[0] == 3900.0
    assert gpu_check.hbm_peak("NVIDIA H200")[0] == 4800.0
    assert gpu_check.hbm_peak("NVIDIA H200 NVL")[0] == 4800.0
    gbps, label = gpu_check.hbm_peak("NVIDIA A100-SXM4-80GB")
    assert gbps is None and "--hbm-gbps" in label
    assert gpu_check.hbm_peak("NVIDIA A100-SXM4-80GB", 2039.0) == (2039.0, "--hbm-gbps 2039 GB/s")


def test_model_directory_loads_in_transformers_and_stagemesh(tmp_path):
    from transformers import AutoTokenizer

    from stagemesh.core.model_config import ModelConfig

    total = gpu_check.write_model(tmp_path, "tiny", "bfloat16", "cpu", shard_bytes=40_000)  # several shards
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    cfg = ModelConfig.from_path(tmp_path)
    assert (cfg.num_hidden_layers, cfg.vocab_size, cfg.eos_token_ids) == (2, 512, (2,))
    tiny = gpu_check.hf_config("tiny", "bfloat16")
    assert total == 2 * sum(math.prod(d) for _, d in gpu_check.tensor_shapes(tiny))
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    assert len(tok) == 512 and tok.decode([5, 511]) == "w5 w511"


@pytest.mark.slow
def test_dry_run_end_to_end():
    """The whole script on CPU (a tiny model through `stagemesh serve` and LocalEngine): about 25 s."""
    proc = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--budget", "150"], capture_output=True,
                          text=True, timeout=200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    for arm in ("mesh (`stagemesh serve`)", "in-process (LocalEngine)"):
        assert f"| {arm} | batch 1 | 2/2 x 1 |" in out and f"| {arm} | concurrent | 8/8 x 8 |" in out
    assert "| batch 1 | " in out and "(target >= 0.95:" in out and "(target >= 0.8:" in out
    assert "Failed requests" not in out and "not run" not in out
