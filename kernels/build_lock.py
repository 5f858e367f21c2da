"""One compile of the CPU kernels at a time per build folder, and none held up by a compile that died.

torch's cpp_extension.load guards its build folder with a bare lock file (`lock`, made with O_EXCL and removed
when the build ends): a process killed during its compile leaves it behind, and every later load waits for it
for ever, without a word. Builders here first take an flock on a file beside it, which names its holder's pid
and which the kernel releases with its holder however that ends. Holding it, a torch lock file still in the
folder is one a dead compile left: it is taken over, with a log line. A live holder is waited for, with a log
line, at most STAGEMESH_KERNEL_BUILD_TIMEOUT seconds (default 600), then KernelBuildTimeout says who holds it.
"""
from __future__ import annotations

import fcntl
import logging
import os
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

log = logging.getLogger("stagemesh.kernels")
LOCK_NAME = "stagemesh-build.lock"  # ours: an flock, with the holder's pid in it
TORCH_LOCK_NAME = "lock"  # torch.utils.cpp_extension's FileBaton
TIMEOUT_ENV = "STAGEMESH_KERNEL_BUILD_TIMEOUT"
DEFAULT_TIMEOUT_S = 600.0
POLL_S = 0.2


class KernelBuildTimeout(RuntimeError):
    """Another process held the build folder for longer than the bound."""


def timeout_s() -> float:
    raw = os.environ.get(TIMEOUT_ENV)
    try:
        return float(raw) if raw else DEFAULT_TIMEOUT_S
    except ValueError:
        raise ValueError(f"{TIMEOUT_ENV}={raw!r} is not a number of seconds") from None


def _try_lock(f) -> bool:
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def _holder(f) -> str:
    f.seek(0)
    return f.read().strip() or "unknown"


@contextmanager
def exclusive_build(build_dir: Path) -> Iterator[None]:
    """Hold the build folder (created if need be) while the body compiles into it."""
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / LOCK_NAME, "a+") as f:
        try:
            locked = _try_lock(f)
        except OSError as err:  # a filesystem without flock (some network ones): torch's lock alone, as before
            log.warning("cannot lock %s (%s): compiling under torch's lock file alone", f.name, err.strerror)
            yield
            return
        if not locked:
            _wait(f, build_dir)
        previous = _holder(f)
        f.seek(0)
        f.truncate()
        f.write(f"{os.getpid()}\n")
        f.flush()
        _take_over(build_dir / TORCH_LOCK_NAME, previous)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _wait(f, build_dir: Path) -> None:
    limit = timeout_s()
    holder = _holder(f)
    log.info("waiting for pid %s, which is compiling the CPU kernels in %s (at most %.0fs, %s)", holder,
             build_dir, limit, TIMEOUT_ENV)
    deadline = time.monotonic() + limit
    while not _try_lock(f):
        if time.monotonic() >= deadline:
            raise KernelBuildTimeout(
                f"pid {_holder(f)} has held the CPU kernel build in {build_dir} for more than {limit:.0f}s "
                f"({TIMEOUT_ENV}); let it finish, or stop it and start again")
        time.sleep(POLL_S)
    log.info("pid %s finished with the CPU kernel build in %s", holder, build_dir)


def _take_over(torch_lock: Path, previous: str) -> None:
    """Under our flock, a torch lock file is one a compile left when it died (torch removes its own)."""
    if not torch_lock.exists():
        return
    log.warning("taking over the CPU kernel build lock %s, left by a compile that died (pid %s)", torch_lock,
                previous)
    torch_lock.unlink(missing_ok=True)
