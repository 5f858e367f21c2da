"""The control channel from a stage's TP rank 0 to its followers (stage_worker.control): messages arrive whole
and in order through a real pipe into a child process, a payload larger than the pipe included; a follower
gone is named; a follower skips what belongs to an epoch it is not in."""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import threading

import pytest

from stage_worker import control
from stagemesh.core.errors import StagemeshError

# a child that reads messages as a follower does and prints what it got, until the pipe closes
ECHO = """
import hashlib, sys
from stage_worker import control
reader = control.Reader(sys.stdin.fileno())
while (message := reader.read()) is not None:
    kind, epoch, payload = message
    print(kind, epoch, len(payload), hashlib.sha256(payload).hexdigest(), flush=True)
"""


def child() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", ECHO], stdin=subprocess.PIPE, stdout=subprocess.PIPE)


def test_messages_arrive_whole_and_in_order_and_the_pipe_closing_ends_the_reader():
    procs = [child(), child()]
    try:
        channel = control.FollowerChannel(procs)
        sent = [(control.JOIN, 3, b"join"), (control.FORWARD, 3, os.urandom(5_000_000)),  # past the pipe's size
                (control.LEAVE, 3, b""), (control.FORWARD, 4, control.step_message(b"\x01\x02", [7, -1]))]
        sent += [(control.FORWARD, 4, os.urandom(n)) for n in range(0, 3000, 97)]  # headers split over reads
        writer = threading.Thread(target=lambda: [channel.send(*m) for m in sent])
        writer.start()  # while the children read: a payload past the pipe's size waits for them
        got = [[p.stdout.readline().decode().split() for _ in sent] for p in procs]
        writer.join()
        want = [[str(k), str(e), str(len(b)), hashlib.sha256(b).hexdigest()] for k, e, b in sent]
        assert got == [want, want]
        for p in procs:
            p.stdin.close()
            assert p.wait(timeout=30) == 0
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_a_follower_gone_is_named():
    procs = [child(), child()]
    try:
        procs[1].kill()
        procs[1].wait()
        channel = control.FollowerChannel(procs)
        with pytest.raises(StagemeshError, match="TP follower 2 is gone"):
            for _ in range(100):  # the first writes may land in the pipe before the kernel sees no reader
                channel.send(control.FORWARD, 1, b"x" * 4096)
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_a_follower_skips_what_belongs_to_an_epoch_it_is_not_in():
    """Out of an epoch (none joined, or one that broke) every message but JOIN is skipped unread: `serve` with
    no runner at all returns at the pipe's end."""
    from stage_worker.follower import serve

    read_fd, write_fd = os.pipe()
    with os.fdopen(write_fd, "wb") as out:
        for kind, epoch in [(control.FORWARD, 5), (control.KV_EXPORT, 5), (control.EPLB_REBALANCE, 5),
                            (control.LEAVE, 5), (99, 6)]:
            out.write(control.HEADER.pack(kind, epoch, 3) + b"abc")
    try:
        serve(None, control.Reader(read_fd))
    finally:
        os.close(read_fd)


@pytest.mark.slow
def test_a_tp_stage_idle_past_the_collective_deadline_still_serves(tiny_model_dir, tmp_path):
    """A follower waits for its next instruction on the pipe, with no deadline. (When steps came over the TP
    group, a follower idle for the collective deadline gave up its epoch, and the next request hung on rank 0's
    broadcast until its own deadline.) Here the collective deadline is 5 s and the stage idles 12."""
    import time

    from mesh import Mesh
    from stagemesh.core.sampling_params import SamplingParams

    mesh = Mesh(tiny_model_dir("llama"), [4], tp=[2], log_dir=tmp_path)
    mesh.env["STAGEMESH_DEADLINES"] = "collective_s=5"
    sampling = SamplingParams(max_tokens=8)
    with mesh:
        first = mesh.submit("first", [5, 6, 7], sampling)
        time.sleep(12)
        assert mesh.submit("after-idle", [5, 6, 7], sampling, timeout=60) == first
    log = (tmp_path / "stage0.log").read_text()
    assert "ended" not in log and "joined epoch 1 " in log and "joined epoch 2 " not in log


def test_deadlines_from_the_environment_are_checked():
    from stagemesh.core.deadlines import from_env

    assert from_env("collective_s=300, store_s=60").collective_s == 300.0
    assert from_env(None).collective_s == 120.0
    for bad in ("collective=3", "collective_s=-1", "collective_s=soon", "collective_s"):
        with pytest.raises(StagemeshError, match="STAGEMESH_DEADLINES: .* is not name=seconds"):
            from_env(bad)
