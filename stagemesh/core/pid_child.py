"""A child process held by its pid, with the part of `subprocess.Popen`'s interface stagemesh's callers use. Two kinds
are not Popen's: the children of a fork server (stagemesh.entry.forkserver) and a stage's forked TP followers
(stage_worker.follower_start). Each says how it learns its child's end (poll, wait); signalling is the same for both.
"""
from __future__ import annotations

import os
import signal


class PidChild:
    """Popen's send_signal / terminate / kill for a child known by its pid; a subclass gives poll()."""

    pid: int
    returncode: int | None

    def poll(self) -> int | None:
        raise NotImplementedError

    def send_signal(self, sig: int) -> None:
        """As Popen's: nothing once the child's end is known, and nothing if it has just gone."""
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} pid={self.pid} returncode={self.returncode}>"


def thread_count() -> int:
    """This process's threads, as the kernel counts them (a fork is safe only with one)."""
    return len(os.listdir("/proc/self/task"))
