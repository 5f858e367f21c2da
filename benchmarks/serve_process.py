"""`stagemesh serve` as a benchmark's subject: started in a session of its own, ready once every replica
serves, stopped with SIGTERM (its children with it). Imported by the benchmark scripts beside it."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import requests


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_serve(args: list[str], log: Path | None = None, env: dict | None = None, timeout: float = 600,
                cwd: Path | None = None) -> tuple[subprocess.Popen, str]:
    """(the process, its base URL) once /health says every replica is healthy; exits with its log if it fails.
    `cwd`: where it runs (`python -m stagemesh` from a checkout there, first on its path)."""
    port = free_port()
    out = open(log, "ab") if log is not None else subprocess.DEVNULL
    proc = subprocess.Popen([sys.executable, "-m", "stagemesh", "serve", "--port", str(port), "--grpc-port",
                             str(free_port()), *args], stdout=out, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True, cwd=cwd)
    base, start = f"http://127.0.0.1:{port}", time.monotonic()
    while True:
        if proc.poll() is not None or time.monotonic() - start > timeout:
            stop(proc)
            sys.exit(f"`stagemesh serve {' '.join(args)}` did not come up" +
                     (f":\n{log.read_text()[-3000:]}" if log is not None else ""))
        try:
            health = requests.get(f"{base}/health", timeout=2)
            if health.status_code == 200 and all(r["healthy"] for r in health.json()["replicas"]):
                return proc, base
        except (requests.RequestException, ValueError, KeyError):
            pass
        time.sleep(0.2)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(timeout=120)
