"""A real redis-server for tests: on a free loopback port, no persistence (`--save "" --appendonly no`), its
files in a folder of the test's; killed and started again on the same port to play a store that goes down and
comes back. Tests that need it skip where redis-server is not installed (`make install` installs it as root on
Debian)."""
from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import redis
from mesh import free_port

INSTALLED = shutil.which("redis-server") is not None
MISSING = "redis-server is not installed (`make install` installs Debian's redis-server as root)"



class RedisServer:
    def __init__(self, directory: Path, port: int | None = None):
        self.dir, self.port = directory, port or free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10) -> None:
        argv = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--dir", str(self.dir), "--logfile", str(self.dir / f"redis-{self.port}.log")]
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}; see {self.dir}")
            try:
                if self.client().ping():
                    return
            except redis.ConnectionError:
                time.sleep(0.05)
        raise TimeoutError(f"redis-server on port {self.port} did not answer within {timeout} s")

    def kill(self) -> None:
        """Down at once, as a crash: its connections reset, its data gone."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5, socket_connect_timeout=5)
