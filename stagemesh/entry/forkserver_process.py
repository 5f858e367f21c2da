"""The fork server process itself (`python -m stagemesh.entry.forkserver_process FD`): imports PRELOAD once, then
forks one child per request on its socket and reports each child's exit. What the callers use, and why it is safe to
fork here, is stagemesh.entry.forkserver. This module imports nothing of stagemesh: stagemesh's modules may read the
environment when imported, and the children set theirs after the fork.
"""

from __future__ import annotations

import array
import gc
import io
import json
import os
import selectors
import signal
import socket
import sys

# What the services import anyway, third-party only. Past the top-level packages, transformers' configs pull
# activations, hub_kernels and core_model_loading, and with them torch.distributed.tensor and sympy (0.8 s of CPU on
# a Zen 4); a stage imports xgrammar (structured outputs); a router redis (limits, the Responses store); every
# service grpc_health. Preloaded, a forked router starts on 0.7 CPU-s instead of 1.8, a forked stage of the default
# model on 1.8 instead of 2.6 (docs/testing.md). None of them reads a LATE_PREFIXES variable or starts a thread.
PRELOAD = ("torch", "transformers", "transformers.models.auto.tokenization_auto", "transformers.configuration_utils",
           "transformers.activations", "transformers.core_model_loading", "transformers.integrations.hub_kernels",
           "tokenizers", "safetensors.torch", "numpy", "grpc", "grpc.aio", "grpc_health.v1.health",
           "google.protobuf.message", "aiohttp", "jinja2", "xgrammar", "redis", "redis.asyncio", "pydantic", "uvloop",
           "psutil")
MAX_MESSAGE = 1 << 20
PR_SET_NAME = 15
REAP_INTERVAL_S = 0.05

def _recv(sock: socket.socket) -> tuple[dict | None, list[int]]:
    fds = array.array("i")
    msg, anc, _flags, _addr = sock.recvmsg(MAX_MESSAGE, socket.CMSG_SPACE(2 * fds.itemsize))
    for level, kind, data in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[:len(data) - len(data) % fds.itemsize])
    return (json.loads(msg) if msg else None), list(fds)


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _reap(sock: socket.socket, children: set[int]) -> None:
    while children:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            return
        children.discard(pid)
        sock.send(json.dumps({"exit": pid, "code": os.waitstatus_to_exitcode(status)}).encode())


def _serve(sock: socket.socket) -> dict | None:
    """The server's loop. Returns in a forked child (with its request), or None when the caller has gone."""
    sel = selectors.DefaultSelector()
    sel.register(sock, selectors.EVENT_READ)
    children: set[int] = set()
    while True:
        ready = sel.select(timeout=REAP_INTERVAL_S)
        _reap(sock, children)
        if not ready:
            continue
        req, fds = _recv(sock)
        if req is None:  # the caller closed its end or died
            return None
        problem = (f"the fork server has {_threads()} threads and cannot fork safely" if _threads() != 1 else
                   "a request needs two descriptors (stdout, stderr)" if len(fds) != 2 else None)
        if problem:
            sock.send(json.dumps({"error": problem}).encode())
            for fd in fds:
                os.close(fd)
            continue
        pid = os.fork()
        if pid == 0:
            sel.close()
            sock.close()
            req["fds"] = fds
            return req
        children.add(pid)
        for fd in fds:
            os.close(fd)
        sock.send(json.dumps({"pid": pid}).encode())


def _become(req: dict) -> None:
    """In the forked child: become the process `python -m stagemesh *argv` would have been."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if req.get("pgroup"):
        os.setpgid(0, 0)
    out, err = req["fds"]
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(out, 1)
    os.dup2(err, 2)
    for fd in {null, out, err} - {0, 1, 2}:
        os.close(fd)
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    if os.environ.get("PYTHONUNBUFFERED"):
        for stream in (sys.stdout, sys.stderr):
            if isinstance(stream, io.TextIOWrapper):
                stream.reconfigure(write_through=True)
    if "numpy" in sys.modules:  # forked children would otherwise share one numpy seed
        sys.modules["numpy"].random.seed()
    _name(req)
    import runpy

    if req.get("script"):  # `python SCRIPT *argv`
        sys.path[0] = os.path.dirname(os.path.abspath(req["script"]))
        sys.argv = [req["script"], *req["argv"]]
        runpy.run_path(req["script"], run_name="__main__")
        return
    sys.path[0] = req["cwd"]  # as `python -m stagemesh` sets it
    sys.argv = [os.path.join(os.path.dirname(os.path.dirname(__file__)), "__main__.py"), *req["argv"]]
    runpy.run_module("stagemesh", run_name="__main__", alter_sys=True)


def _name(req: dict) -> None:
    """The child's name in top and `ps -o comm` (sm-stage, sm-router, ...): its command line is the fork server's."""
    what = os.path.basename(req["script"]).removesuffix(".py") if req.get("script") else (req["argv"] or ["?"])[0]
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").prctl(PR_SET_NAME, f"sm-{what}".encode()[:15])
    except OSError:
        pass


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sock = socket.socket(fileno=int(sys.argv[1]))
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # else numpy's import starts a thread pool
    for name in PRELOAD:
        try:
            __import__(name)
        except ImportError:
            pass
    # What PRELOAD built stays for every child's life: collected once here and frozen (gc.freeze, which Python's
    # docs advise before a fork), a child's own start-up collection (stagemesh.core.heap) walks only what it built
    # (0.25 s of CPU less a child on a Zen 4), and its collections never write to the pages it shares with us.
    gc.collect()
    gc.freeze()
    req = _serve(sock)
    if req is not None:
        _become(req)  # then the interpreter's normal exit, as a spawned child's



if __name__ == "__main__":
    main()
