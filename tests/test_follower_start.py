"""How a stage starts its TP followers (stage_worker.follower_start): with STAGEMESH_WORKER_MULTIPROC_METHOD=forkserver
they are forked from the stage before its weights load, where that is safe, and spawned otherwise; a forked
follower serves as a spawned one does (transformers' tokens: tests/test_mesh_parity.py and every TP test that starts
a Mesh), ends without a word when its stage refuses before telling it anything, and dies with its stage."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from mesh import Mesh
from parity import prompts
from stagemesh.core.sampling_params import SamplingParams
from stagemesh.entry.forkserver import METHOD_ENV
from tiny_models import reference_model, reference_tokens

ROOT = Path(__file__).resolve().parents[1]

# in a fresh interpreter (one thread), as a stage's rank 0 is when it forks
FORK_THEN_CLOSE = """
import logging, sys, threading
logging.basicConfig(level=logging.INFO, format="%(message)s")
from stage_worker.follower_start import fork_followers
if sys.argv[1] == "thread":
    threading.Thread(target=threading.Event().wait, daemon=True).start()
forked = fork_followers(3)
print("forked", len(forked), flush=True)
for f in forked:
    f.stdin.close()  # rank 0 refused its flags before any START
print("codes", [f.wait(60) for f in forked], "out", [f.stdout.read() for f in forked], flush=True)
"""


def _fork_then_close(method: str, mode: str = "") -> subprocess.CompletedProcess:
    env = {**os.environ, METHOD_ENV: method}
    return subprocess.run([sys.executable, "-c", FORK_THEN_CLOSE, mode], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)


def test_forked_followers_told_nothing_end_quietly():
    done = _fork_then_close("forkserver")
    assert done.returncode == 0, done.stderr
    assert "TP followers 1..2 forked from this stage" in done.stderr
    assert "forked 2" in done.stdout
    assert "codes [0, 0] out [b'', b'']" in done.stdout
    # nothing from the followers: no "sent no START message", no traceback
    assert "START" not in done.stderr and "Traceback" not in done.stderr, done.stderr


@pytest.mark.parametrize("method, mode, why", [("spawn", "", "spawn is the start method"),
                                               ("forkserver", "thread", "the stage has 2 threads")])
def test_followers_are_spawned_where_a_fork_is_not_asked_for_or_not_safe(method, mode, why):
    done = _fork_then_close(method, mode)
    assert done.returncode == 0, done.stderr
    assert f"TP followers will be spawned ({why})" in done.stderr
    assert "forked 0" in done.stdout


@pytest.mark.slow
def test_a_tp2_stage_forks_its_follower_which_serves_and_dies_with_it(tiny_model_dir, tmp_path):
    model_dir = tiny_model_dir("llama")
    batch = prompts(384, (5, 40, 17))
    ref = reference_model(model_dir)
    want = [reference_tokens(ref, p, 8) for p in batch]
    mesh = Mesh(model_dir, split=[4], tp=[2], handoff="grpc", log_dir=tmp_path)
    mesh.env[METHOD_ENV] = "forkserver"
    with mesh:
        assert mesh.generate(batch, SamplingParams(max_tokens=8, temperature=0.0)) == want
        stage = psutil.Process(mesh.stages[0].pid)
        (follower,) = stage.children()
        assert follower.name() == "tp-follower-1"
        assert "TP followers 1..1 forked from this stage" in (tmp_path / "stage0.log").read_text()
        mesh.kill_stage(0)
        deadline = time.monotonic() + 10
        while follower.is_running() and follower.status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline, "the forked follower outlived its stage"
            time.sleep(0.05)
