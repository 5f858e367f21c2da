"""How a stage's rank 0 starts its TP followers (stage_worker.follower): spawned, or forked from the stage.

Spawned (the default): `python -m stage_worker.follower`, which imports torch and the stage's modules again (about
2 s of CPU and wall time a follower, before it reads a byte of its shard).

Forked (STAGEMESH_WORKER_MULTIPROC_METHOD=forkserver, which already has the services forked from a warm
interpreter: stagemesh.entry.forkserver): rank 0 forks its followers before its own weights load, while it is as
safe to fork as a fork server is: one thread, no torch op run on more than one thread, no CUDA context. Each child
waits on its stdin for the START message rank 0 sends once its settings are whole, then runs as a spawned follower
would. Where the stage is not in that state (a thread started: a metrics endpoint, a trace exporter, an OpenMP
pool), its followers are spawned, and its log says why.

Either way a follower is rank 0's child, its stdin the control channel (stage_worker.control), its stdout the
`ready` line; rank 0 holds it by the part of `subprocess.Popen`'s interface it uses (stdin, stdout, pid, poll,
wait, kill).
"""
from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
import time
import traceback

from stagemesh.core.pid_child import PidChild, thread_count
from stagemesh.core.start_method import method

log = logging.getLogger("stagemesh.stage")

PR_SET_NAME = 15
MAX_FORKED = 64  # more followers than any device count: the flags are wrong, and spawning names the error later


class ForkedFollower(PidChild):
    """A follower forked by rank 0: its pipes, its pid, Popen's poll / wait (and PidChild's signals)."""

    def __init__(self, pid: int, stdin_fd: int, stdout_fd: int):
        self.pid = pid
        self.returncode: int | None = None
        self.args = ["stage_worker.follower (forked)"]
        self.stdin = os.fdopen(stdin_fd, "wb")
        self.stdout = os.fdopen(stdout_fd, "rb")

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere: it is gone
                self.returncode = -signal.SIGKILL
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
            time.sleep(0.01)
        assert self.returncode is not None
        return self.returncode


def why_not_fork(ranks: int) -> str | None:
    """Why rank 0 cannot fork its followers now (None: it can)."""
    if method() != "forkserver":
        return "spawn is the start method"
    if not 1 < ranks <= MAX_FORKED:
        return f"{ranks} ranks"
    if (threads := thread_count()) != 1:
        return f"the stage has {threads} threads"
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "CUDA is initialised"
    return None


def fork_followers(ranks: int) -> list[ForkedFollower]:
    """Followers 1..ranks-1 forked now, each waiting for its START message; [] where they are to be spawned."""
    why = why_not_fork(ranks)
    if why is not None:
        if ranks > 1:
            log.info("TP followers will be spawned (%s)", why)
        return []
    sys.stdout.flush()
    sys.stderr.flush()
    forked: list[ForkedFollower] = []
    for tp_rank in range(1, ranks):
        to_child, from_parent = os.pipe()  # the child's stdin: rank 0 writes
        to_parent, from_child = os.pipe()  # the child's stdout: the child writes `ready`
        pid = os.fork()
        if pid == 0:
            ours = {fd for f in forked for fd in (f.stdin.fileno(), f.stdout.fileno())} | {from_parent, to_parent}
            _run_child(tp_rank, to_child, from_child, ours)  # never returns
        os.close(to_child)
        os.close(from_child)
        forked.append(ForkedFollower(pid, from_parent, to_parent))
    log.info("TP followers 1..%d forked from this stage (STAGEMESH_WORKER_MULTIPROC_METHOD=forkserver)", ranks - 1)
    return forked


def _run_child(tp_rank: int, stdin_fd: int, stdout_fd: int, ours: set[int]) -> None:
    """In a forked follower: become what `python -m stage_worker.follower` would have been, then exit."""
    code = 1
    try:
        for fd in ours:  # rank 0's ends, and the other followers': a pipe must close when its owner goes
            os.close(fd)
        os.dup2(stdin_fd, 0)
        os.dup2(stdout_fd, 1)
        os.close(stdin_fd)
        os.close(stdout_fd)
        try:  # its name in top and `ps -o comm` (its command line is rank 0's)
            ctypes.CDLL("libc.so.6").prctl(PR_SET_NAME, f"tp-follower-{tp_rank}".encode()[:15])
        except OSError:
            pass
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for handler in logging.root.handlers[:]:  # the follower's own log format, as a spawned one has
            logging.root.removeHandler(handler)
        if "numpy" in sys.modules:  # forked children would otherwise share one numpy seed
            sys.modules["numpy"].random.seed()
        from stage_worker import follower

        follower.main(quiet_without_start=True)
        code = 0
    except SystemExit as exc:  # as the interpreter would end a spawned follower
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if exc.code is not None and not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - a forked child must not return into rank 0's code
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def start_follower(forked: list[ForkedFollower], tp_rank: int, start: bytes) -> subprocess.Popen | ForkedFollower:
    """Follower `tp_rank`, told its START message: the forked one where there is one, else spawned now."""
    if forked:
        proc: subprocess.Popen | ForkedFollower = forked[tp_rank - 1]
    else:
        proc = subprocess.Popen([sys.executable, "-m", "stage_worker.follower"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, env=os.environ.copy())
    assert proc.stdin is not None  # (started with a pipe on stdin)
    proc.stdin.write(start)  # (its first message: it reads it first)
    proc.stdin.flush()
    return proc
