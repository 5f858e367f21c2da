"""A CPU kernel build killed during its compile holds up no later load, and a live one is waited for, with a log line
and a bound. Real processes and torch's real cpp_extension build of a small extension; a compiler wrapper that waits
(on a file the test creates) keeps a compile going for as long as the test needs."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler here")]

SOURCE = r"""
#include <Python.h>
#define NAME_(n) #n
#define NAME(n) NAME_(n)
#define INIT_(n) PyInit_##n
#define INIT(n) INIT_(n)
static PyObject* answer(PyObject*, PyObject*) { return PyLong_FromLong(42); }
static PyMethodDef methods[] = {{"answer", answer, METH_NOARGS, nullptr}, {nullptr, nullptr, 0, nullptr}};
static PyModuleDef module = {PyModuleDef_HEAD_INIT, NAME(TORCH_EXTENSION_NAME), nullptr, -1, methods};
PyMODINIT_FUNC INIT(TORCH_EXTENSION_NAME)(void) { return PyModule_Create(&module); }
"""
# stagemesh's load of a module, as a stage's start makes it (kernels.cpu_ops.load, with these sources)
LOAD = """
import logging, sys
from pathlib import Path
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
from kernels import cpu_ops
module = cpu_ops.load_module(sys.argv[1], [Path(sys.argv[2])], [], Path(sys.argv[3]))
print("answer:", module.answer() if module is not None else None, flush=True)
"""
# a g++ (its name is what torch accepts) that, compiling, says so in a file, then waits for the test's word (at
# most 2 minutes: ninja runs it in a process group of its own, which outlives a killed loader's)
WRAPPER = """#!/bin/sh
case " $* " in *" -c "*) touch "$COMPILE_STARTED"; n=0
  while [ ! -e "$COMPILE_GO" ] && [ $n -lt 1200 ]; do sleep 0.1; n=$((n+1)); done;; esac
exec {cxx} "$@"
"""


@pytest.fixture
def build(tmp_path):
    source = tmp_path / "answer.cpp"
    source.write_text(SOURCE)
    wrapper = tmp_path / "bin" / "g++"
    wrapper.parent.mkdir()
    wrapper.write_text(WRAPPER.format(cxx=shutil.which("c++")))
    wrapper.chmod(0o755)
    build_dir = tmp_path / "build"
    procs: list[subprocess.Popen] = []

    def start(name: str, held: bool = False, **env: str) -> subprocess.Popen:
        """A process that loads the module; held: its compile waits until go() (COMPILE_STARTED set once it runs)."""
        extra = {"CXX": str(wrapper), "COMPILE_STARTED": str(tmp_path / "started"),
                 "COMPILE_GO": str(tmp_path / "go")} if held else {}
        log = open(tmp_path / f"{name}.log", "wb")
        proc = subprocess.Popen([sys.executable, "-c", LOAD, "answer_ext", str(source), str(build_dir)],
                                env={**os.environ, **extra, **env}, stdout=log, stderr=subprocess.STDOUT,
                                cwd=Path(__file__).parents[1], process_group=0)
        log.close()
        procs.append(proc)
        return proc

    def output(name: str) -> str:
        return (tmp_path / f"{name}.log").read_text()

    def wait_for(what, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while not what():
            assert time.monotonic() < deadline, {p.args[-1]: p.poll() for p in procs}
            time.sleep(0.05)

    build.start, build.output, build.wait_for = start, output, wait_for
    build.started, build.go, build.dir = tmp_path / "started", tmp_path / "go", build_dir
    try:
        yield build
    finally:
        build.go.touch()  # a held compile left by a killed loader (in ninja's own process group) ends too
        for proc in procs:  # each with what it started (ninja, the compiler)
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_a_compile_killed_midway_leaves_a_lock_the_next_load_takes_over(build):
    killed = build.start("killed", held=True)
    build.wait_for(build.started.exists)
    os.killpg(killed.pid, signal.SIGKILL)  # the stage and its compiler, as a container's kill
    killed.wait()
    assert (build.dir / "lock").exists()  # torch's lock file, as the dead compile left it
    proc = build.start("next")
    assert proc.wait(timeout=90) == 0, build.output("next")
    out = build.output("next")
    assert "answer: 42" in out, out
    assert (f"WARNING stagemesh.kernels: taking over the CPU kernel build lock {build.dir / 'lock'}, left by a "
            f"compile that died (pid {killed.pid})") in out


def test_a_live_compile_is_waited_for_with_a_log_line_and_a_bound(build):
    holder = build.start("holder", held=True)
    build.wait_for(build.started.exists)
    bounded = build.start("bounded", STAGEMESH_KERNEL_BUILD_TIMEOUT="1")
    waiting = build.start("waiting")
    build.wait_for(lambda: f"waiting for pid {holder.pid}, which is compiling" in build.output("waiting"))
    assert bounded.wait(timeout=60) == 0
    out = build.output("bounded")
    assert (f"ERROR stagemesh.kernels: CPU kernels unavailable, the CPU path uses the torch reference (slower): pid "
            f"{holder.pid} has held the CPU kernel build in {build.dir} for more than 1s "
            "(STAGEMESH_KERNEL_BUILD_TIMEOUT)") in out, out
    assert "answer: None" in out
    build.go.touch()  # the holder's compile goes on and ends
    assert holder.wait(timeout=90) == 0, build.output("holder")
    assert waiting.wait(timeout=60) == 0, build.output("waiting")
    assert "answer: 42" in build.output("holder") and "answer: 42" in build.output("waiting")
    assert f"pid {holder.pid} finished with the CPU kernel build in {build.dir}" in build.output("waiting")
    assert not (build.dir / "lock").exists()
