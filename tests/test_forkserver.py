"""The fork server (stagemesh.entry.forkserver): a forked child is the process a spawn would have started."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from stagemesh.entry import forkserver

SCRIPT = """
import gc, json, os, sys
print(json.dumps({"argv": sys.argv[1:], "cwd": os.getcwd(), "env": os.environ.get("STAGEMESH_PROBE"),
                  "omp": os.environ.get("OMP_NUM_THREADS"), "ppid": os.getppid(), "pgid": os.getpgid(0),
                  "path0": sys.path[0], "torch_loaded": "torch" in sys.modules, "frozen": gc.get_freeze_count(),
                  "comm": open("/proc/self/comm").read().strip()}))
print("to stderr", file=sys.stderr)
if sys.argv[1:] == ["sleep"]:
    import time
    time.sleep(60)
raise SystemExit(int(sys.argv[1]) if sys.argv[1:] and sys.argv[1].isdigit() else 0)
"""


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "probe.py"
    path.write_text(SCRIPT)
    return str(path)


def run(script, tmp_path, *argv, env=None, name="out"):
    out, err = open(tmp_path / f"{name}.out", "wb"), open(tmp_path / f"{name}.err", "wb")
    with out, err:
        proc = forkserver.spawn_stagemesh(list(argv), env=env, stdout=out, stderr=err, cwd=str(tmp_path),
                                          start_method="forkserver", script=script)
    return proc


def test_a_forked_child_has_its_argv_environment_streams_and_exit_code(script, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "STAGEMESH_PROBE": "one"}
    proc = run(script, tmp_path, "7", env=env)
    assert isinstance(proc, forkserver.ForkedProcess)
    assert proc.wait(60) == 7 and proc.poll() == 7
    seen = json.loads((tmp_path / "out.out").read_text())
    assert seen["argv"] == ["7"] and seen["cwd"] == str(tmp_path) and seen["env"] == "one"
    assert seen["torch_loaded"]  # it came warm: torch was imported before the fork
    assert seen["frozen"] > 10_000  # and that heap frozen (gc.freeze): the child's collections never walk it
    assert seen["path0"] == str(tmp_path)  # as `python SCRIPT` sets sys.path[0]
    assert seen["comm"] == "sm-probe"  # its name in top (its command line is the fork server's)
    assert (tmp_path / "out.err").read_text() == "to stderr\n"
    server = forkserver.server_for(env)
    assert seen["ppid"] == server.proc.pid and seen["pgid"] == os.getpgid(server.proc.pid)
    # a variable read after import (ours) may differ: the same server forks it
    second = run(script, tmp_path, env={**env, "STAGEMESH_PROBE": "two"}, name="second")
    assert second.wait(60) == 0
    again = json.loads((tmp_path / "second.out").read_text())
    assert again["ppid"] == server.proc.pid and again["env"] == "two"


def test_an_environment_the_libraries_read_at_import_gets_its_own_server(script, tmp_path):
    base = {**os.environ, "OMP_NUM_THREADS": "1"}
    one = run(script, tmp_path, env=base, name="one")
    two = run(script, tmp_path, env={**base, "OMP_NUM_THREADS": "2"}, name="two")
    assert one.wait(60) == 0 and two.wait(60) == 0
    first, second = (json.loads((tmp_path / f"{n}.out").read_text()) for n in ("one", "two"))
    assert first["ppid"] != second["ppid"] and second["omp"] == "2"


def test_signals_wait_bounds_and_a_process_group_of_its_own(script, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = open(tmp_path / "s.out", "wb")
    with out:
        proc = forkserver.spawn_stagemesh(["sleep"], env=env, stdout=out, cwd=str(tmp_path), process_group=True,
                                          start_method="forkserver", script=script)
    deadline = time.monotonic() + 60
    while not (tmp_path / "s.out").read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert json.loads((tmp_path / "s.out").read_text().splitlines()[0])["pgid"] == proc.pid
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(0.3)
    proc.terminate()
    assert proc.wait(30) == -signal.SIGTERM


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _comm(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except FileNotFoundError:
        return None


def _outlives(pid: int, caller: subprocess.Popen, timeout_s: float) -> bool:
    """SIGKILL the caller: whether process `pid` is still there timeout_s later."""
    caller.kill()
    caller.wait()
    deadline = time.monotonic() + timeout_s
    while not _gone(pid):
        if time.monotonic() > deadline:
            return True
        time.sleep(0.1)
    return False


def test_the_server_exits_when_its_caller_dies(tmp_path):
    """A caller SIGKILLed: its fork server sees the socket close and exits (serve's children then die with it:
    test_serve and test_api_servers check that end to end)."""
    caller = tmp_path / "caller.py"
    caller.write_text(f"""
import os, sys, time
sys.path.insert(0, {str(forkserver.__file__.rsplit('/stagemesh/', 1)[0])!r})
from stagemesh.entry import forkserver
env = {{**os.environ, "OMP_NUM_THREADS": "1"}}
child = forkserver.spawn_stagemesh(["--version"], env=env, start_method="forkserver")
child.wait(60)
print(forkserver.server_for(env).proc.pid, flush=True)
time.sleep(60)
""")
    proc = subprocess.Popen([sys.executable, str(caller)], stdout=subprocess.PIPE, text=True)
    try:
        server_pid = int(proc.stdout.readline())
        if _outlives(server_pid, proc, 30):
            pytest.fail(f"the fork server (pid {server_pid}) outlived its caller")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_service_the_tests_start_dies_with_the_test_process(tmp_path, default_model_dir):
    """tests/mesh.py's services die with the process that started them: a pytest killed before its teardown
    (SIGKILL here; SIGTERM is the same) leaves no service running on (its fork server exits, and they with it)."""
    caller = tmp_path / "caller.py"
    tests = os.path.dirname(__file__)
    caller.write_text(f"""
import sys, time
sys.path[:0] = [{os.path.dirname(tests)!r}, {tests!r}]
from mesh import Router
router = Router({str(default_model_dir)!r}, ["127.0.0.1:1"])
print(router.proc.pid, flush=True)
time.sleep(120)
""")
    proc = subprocess.Popen([sys.executable, str(caller)], stdout=subprocess.PIPE, text=True)
    router = None
    try:
        router = int(proc.stdout.readline())
        deadline = time.monotonic() + 60  # until the router runs as itself (it set its death signal before that)
        while time.monotonic() < deadline and _comm(router) not in ("sm-router", None):
            time.sleep(0.1)
        if _outlives(router, proc, 60):
            pytest.fail(f"the router (pid {router}) outlived the test process that started it")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if router is not None and not _gone(router):
            os.kill(router, signal.SIGKILL)


def test_an_unknown_start_method_is_refused_by_name(monkeypatch):
    monkeypatch.setenv(forkserver.METHOD_ENV, "fork")
    with pytest.raises(Exception, match="STAGEMESH_WORKER_MULTIPROC_METHOD='fork' is not one of spawn, forkserver"):
        forkserver.method()


def test_past_the_bound_an_idle_server_makes_room_and_a_busy_one_does_not(script, tmp_path, monkeypatch):
    """The test process's own environment drifts (importing ray, lm_eval or peft sets variables), and so does the
    set of servers it needs: the least recently used idle one is stopped for a new one; with none idle, a spawn."""
    monkeypatch.setattr(forkserver, "MAX_SERVERS", 1)
    monkeypatch.setattr(forkserver, "_servers", {})
    base = {**os.environ, "OMP_NUM_THREADS": "1"}
    first = forkserver.server_for(base)
    busy = run(script, tmp_path, "sleep", env={**base, "HF_PROBE": "1"}, name="busy")
    assert isinstance(busy, forkserver.ForkedProcess)
    first.proc.wait(30)  # the idle server was stopped to make room (TimeoutExpired if it was not)
    try:
        cold = run(script, tmp_path, env={**base, "HF_PROBE": "2"}, name="cold")
        assert isinstance(cold, subprocess.Popen) and cold.wait(60) == 0
        assert json.loads((tmp_path / "cold.out").read_text())["ppid"] == os.getpid()
    finally:
        busy.kill()
        busy.wait(30)
        forkserver.close_all()
