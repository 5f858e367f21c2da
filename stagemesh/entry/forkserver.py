"""Start `stagemesh <service>` processes by forking a warm interpreter (STAGEMESH_WORKER_MULTIPROC_METHOD=forkserver).

Every service imports torch and transformers when it starts: 3.5-4 s of CPU on a 2-core Xeon, paid again by each
stage, scheduler and router `serve` starts. A fork server is a child process that imports those libraries once (and
nothing of stagemesh, whose modules may read the environment when imported), then forks one process per request.
The forked process sets its environment, standard streams, process group and argv as `subprocess.Popen` would
have, runs `stagemesh` with its argv, and ends with the interpreter's normal exit (atexit handlers, thread joins,
flushed streams). Its pid is its own: it is signalled, killed and waited for as before (`ForkedProcess` has the
part of Popen's interface the callers use). What differs from a spawned process: its command line in `ps` is the
fork server's (`python -m stagemesh.entry.forkserver_process`), which is why `spawn` stays the default. vLLM's
analogue is VLLM_WORKER_MULTIPROC_METHOD (fork or spawn).

Fork safety: the fork server imports modules only. It opens no channel, starts no thread (numpy's OpenBLAS pool is
held to one thread while it imports), runs no torch op, and checks before every fork that it still has one thread.
Libraries that read the environment when imported (OpenMP's thread count and spin, CUDA's devices, torch's and
transformers' settings) read the fork server's, so a fork server serves only requests whose environment equals its
own apart from the variables read later (LATE_PREFIXES); another environment gets another fork server, and past
MAX_SERVERS a plain spawn.

Lifetime: a fork server lives in a process group of its own, ignores SIGINT (a terminal's Ctrl-C is for its
caller), and exits when its caller closes the socket or dies (the caller's end closes with it). Its children die
with it where they ask to (stagemesh.entry.supervisor.die_with_parent names the fork server as their parent).

The server's side is stagemesh.entry.forkserver_process. Protocol over a SOCK_SEQPACKET socket pair, JSON (never
pickle): the caller sends {"argv", "env", "cwd", "pgroup", "script"} with the child's stdout and stderr as two
SCM_RIGHTS descriptors; the server answers {"pid"} or {"error"}, and {"exit": pid, "code": returncode} when it reaps
that child.
"""

from __future__ import annotations

import array
import atexit
import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time

from stagemesh.core.pid_child import PidChild
from stagemesh.core.start_method import METHOD_ENV, METHODS, method  # noqa: F401  (METHOD_ENV, METHODS: its callers')
from stagemesh.entry.forkserver_process import MAX_MESSAGE

log = logging.getLogger("stagemesh.forkserver")

# Variables none of PRELOAD reads when imported: a child may differ from its fork server in these
# (prometheus_client, which reads PROMETHEUS_MULTIPROC_DIR when imported, is not preloaded).
LATE_PREFIXES = ("STAGEMESH_", "OTEL_", "PYTHONUNBUFFERED", "PYTEST_", "PROMETHEUS_MULTIPROC_DIR")
MAX_SERVERS = 4
SPAWN_TIMEOUT_S = 30.0


def env_key(env: dict[str, str]) -> tuple:
    return tuple(sorted((k, v) for k, v in env.items() if not k.startswith(LATE_PREFIXES)))


class ForkedProcess(PidChild):
    """A child of a fork server, with the part of `subprocess.Popen`'s interface its callers use."""

    def __init__(self, pid: int, args: list[str], server: ForkServer):
        self.pid, self.args, self._server = pid, args, server
        self.returncode: int | None = None
        self._done = threading.Event()
        try:
            self._pidfd: int | None = os.pidfd_open(pid)  # to see its end if the server goes first
        except OSError:
            self._pidfd = None

    def _exited(self, code: int) -> None:
        self.returncode = code
        self._done.set()
        self._close_pidfd()

    def _close_pidfd(self) -> None:
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None

    def _orphan_check(self) -> None:
        """Once the server is gone no exit code comes: the child's end (seen on its pidfd) reads as -SIGKILL."""
        if self._server.dead and self.returncode is None and self._pidfd is not None:
            if select.select([self._pidfd], [], [], 0)[0]:
                self._exited(-signal.SIGKILL)

    def poll(self) -> int | None:
        self._orphan_check()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._done.wait(0.2 if deadline is None else max(min(0.2, deadline - time.monotonic()), 0)):
            self._orphan_check()
            if self.returncode is not None:
                break
            if timeout is not None and deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
        assert self.returncode is not None
        return self.returncode


class ForkServer:
    """One fork server process and the children it forked for this caller."""

    def __init__(self, env: dict[str, str]):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock = ours
        argv = [sys.executable, "-m", "stagemesh.entry.forkserver_process", str(theirs.fileno())]
        self.proc = subprocess.Popen(argv, env=env, pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL,
                                     process_group=0, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
        theirs.close()
        self.dead = False
        self.children: dict[int, ForkedProcess] = {}
        self.replies: list[dict] = []
        self.cond = threading.Condition()
        self.lock = threading.Lock()  # one spawn at a time
        threading.Thread(target=self._read, name="forkserver-reader", daemon=True).start()
        log.info("fork server started (pid %d)", self.proc.pid)

    def _read(self) -> None:
        while True:
            try:
                msg = self.sock.recv(MAX_MESSAGE)
            except OSError:
                msg = b""
            with self.cond:
                if not msg:
                    self.dead = True
                    self.replies.append({"error": f"the fork server (pid {self.proc.pid}) exited"})
                    self.cond.notify_all()
                    return
                data = json.loads(msg)
                if "exit" in data:
                    child = self.children.pop(data["exit"], None)
                    if child is not None:
                        child._exited(data["code"])
                else:
                    self.replies.append(data)
                    self.cond.notify_all()

    def spawn(self, argv: list[str], env: dict[str, str], stdout, stderr, cwd: str | None, pgroup: bool,
              script: str | None = None) -> ForkedProcess:
        opened = []

        def fd(stream, inherit: int, merged: int = 1) -> int:
            if stream is None:
                return inherit
            if stream is subprocess.STDOUT:
                return merged
            if stream is subprocess.DEVNULL:
                opened.append(open(os.devnull, "wb"))
                return opened[-1].fileno()
            return stream.fileno()

        out = fd(stdout, 1)
        fds = [out, fd(stderr, 2, out)]
        req = json.dumps({"argv": argv, "env": env, "cwd": cwd or os.getcwd(), "pgroup": pgroup,
                          "script": script}).encode()
        try:
            with self.lock, self.cond:
                if self.dead:
                    raise RuntimeError(f"the fork server (pid {self.proc.pid}) exited")
                self.sock.sendmsg([req], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
                deadline = time.monotonic() + SPAWN_TIMEOUT_S
                while not self.replies:
                    log.debug("waiting for the fork server to fork `stagemesh %s`", " ".join(argv[:1]))
                    if not self.cond.wait(deadline - time.monotonic()):
                        raise TimeoutError(f"the fork server did not answer a spawn in {SPAWN_TIMEOUT_S:.0f}s")
                reply = self.replies.pop(0)
                if "error" in reply:
                    raise RuntimeError(reply["error"])
                command = [script] if script else ["-m", "stagemesh"]
                child = ForkedProcess(reply["pid"], [sys.executable, *command, *argv], self)
                self.children[child.pid] = child
                return child
        finally:
            for f in opened:
                f.close()

    def shutdown(self) -> None:
        """Tell the server to exit (it does once its loop sees the socket closed: within REAP_INTERVAL_S)."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes the reader and tells the server (a bare close would not)
        except OSError:
            pass
        self.sock.close()

    def close(self, timeout: float = 10.0) -> None:
        self.shutdown()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            log.warning("fork server (pid %d) did not exit in %.0fs: killing it", self.proc.pid, timeout)
            self.proc.kill()
            self.proc.wait()


MERGED = object()  # spawn_stagemesh's default stderr
_servers: dict[tuple, ForkServer] = {}
_guard = threading.Lock()


def server_for(env: dict[str, str]) -> ForkServer | None:
    """This environment's fork server, started on first use. With MAX_SERVERS running, the one used least
    recently that has no live child makes room; None (spawn instead) when every one still has children."""
    key = env_key(env)
    with _guard:
        server = _servers.pop(key, None)  # (re-inserted last: the dict's order is least recently used first)
        if server is not None and server.dead:
            server.close()
            server = None
        if server is None and len(_servers) >= MAX_SERVERS:
            idle = next((k for k, s in _servers.items() if not s.children), None)
            if idle is None:
                log.warning("%d fork servers run, each with children: spawning instead", len(_servers))
                return None
            _servers.pop(idle).close()
        if server is None:
            server = ForkServer(env)
        _servers[key] = server
        return server


def prestart(envs: list[dict[str, str]]) -> None:
    """Start the fork servers these environments will need, all at once (each imports for seconds; started one
    by one at the first spawn of each, the imports would run one after another)."""
    if method() == "forkserver":
        for env in envs:
            server_for(env)


def spawn_stagemesh(argv: list[str], *, env: dict[str, str] | None = None, stdout=None, stderr=MERGED,
                    cwd: str | None = None, process_group: bool = False, start_method: str | None = None,
                    parent_env: str | None = None, script: str | None = None):
    """`subprocess.Popen([python, -m, stagemesh, *argv], stdout=stdout, stderr=stderr, env=env, cwd=cwd)`, forked
    by a fork server when the start method (STAGEMESH_WORKER_MULTIPROC_METHOD unless given) is forkserver. A fork
    server that cannot fork logs why, and the process is spawned instead.
    stderr: by default with stdout (subprocess.STDOUT) when stdout is given, else inherited.
    parent_env: a variable of env that names the child's parent pid (ours, or its fork server's).
    script: run `python SCRIPT *argv` instead of stagemesh (the tests' own worker scripts)."""
    env = dict(os.environ if env is None else env)
    if stderr is MERGED:
        stderr = None if stdout is None else subprocess.STDOUT
    if parent_env:
        env[parent_env] = str(os.getpid())
    if (start_method or method()) == "forkserver":
        server = server_for(env)
        if server is not None:
            try:
                forked_env = {**env, parent_env: str(server.proc.pid)} if parent_env else env
                return server.spawn(argv, forked_env, stdout, stderr, cwd, process_group, script)
            except (OSError, RuntimeError, TimeoutError) as exc:
                log.warning("fork server could not start `stagemesh %s` (%s); spawning it", argv[0] if argv else "",
                            exc)
    command = [script] if script else ["-m", "stagemesh"]
    return subprocess.Popen([sys.executable, *command, *argv], stdout=stdout, stderr=stderr, env=env, cwd=cwd,
                            process_group=0 if process_group else None)


def close_all() -> None:
    """Stop every fork server this process started (their children go on as orphans, or die with them where they
    asked to)."""
    with _guard:
        servers = list(_servers.values())
        _servers.clear()
    for server in servers:  # all told first: they exit side by side
        server.shutdown()
    deadline = time.monotonic() + 10.0
    for server in servers:
        server.close(max(deadline - time.monotonic(), 0.1))


atexit.register(close_all)
