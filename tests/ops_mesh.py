"""`stagemesh serve` for the operations tests (rollout, scaling, autoscaling), and the load they run under.

Serve: a real serve process with a stagemesh cache of its own (where its admin file is), its log, its admin API;
leaving the block SIGTERMs it and checks that it exits 0 with no child left. Load: clients that stream requests
over and over (resuming a cut stream with Last-Event-ID, as any SSE client can) until told to stop; each answer
is checked token by token against transformers' greedy tokens."""
from __future__ import annotations

import json
import os
import re
import signal
import tempfile
import threading
import time
from pathlib import Path

import requests

from mesh import free_port, start_serve
from sse_client import stream


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def metrics_dirs(pids) -> list[Path]:
    """The routers' shared metrics folders (serve makes one in the temporary folder and removes it when it stops)
    that these processes wrote in: a test that SIGKILLs serve, which cannot remove it then, removes them."""
    names = {str(p) for p in pids}
    return [d for d in Path(tempfile.gettempdir()).glob("stagemesh-router-metrics-*")
            if any(f.stem.rsplit("_", 1)[-1] in names for f in d.glob("*.db"))]


class Serve:
    def __init__(self, model_dir: Path, tmp_path: Path, *flags: str):
        self.cache, self.log = tmp_path / "cache", tmp_path / "serve.log"
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        # (the compiled kernels stay where conftest put them: STAGEMESH_KERNEL_CACHE)
        # operations restart, add and replace children: serve forks them from a warm fork server (start_serve)
        own = {"STAGEMESH_CACHE": str(self.cache), "PYTHONUNBUFFERED": "1"}
        self.env = {**os.environ, **own}  # for the CLI commands a test runs at this serve (rollout, scale)
        self.proc = start_serve([str(model_dir), "--port", str(self.port), "--grpc-port", "0", "--threads", "1",
                                 "--handoff", "grpc", *flags], self.log, own)

    def __enter__(self) -> "Serve":
        return self

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:
            self.stop()

    def text(self) -> str:
        return self.log.read_text()

    def replicas(self) -> list[dict]:
        """The router's replicas (its /ready body), [] while it does not answer."""
        try:
            return requests.get(f"{self.base_url}/ready", timeout=2).json()["replicas"]
        except (requests.RequestException, ValueError, KeyError):
            return []

    def wait_ready(self, num_replicas: int, timeout: float = 180) -> None:
        """Until the router balances over exactly num_replicas healthy replicas."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"serve exited with {self.proc.returncode}:\n{self.text()[-4000:]}"
            reps = self.replicas()
            if len(reps) == num_replicas and all(r["healthy"] and not r["cordoned"] for r in reps):
                return
            time.sleep(0.2)
        raise AssertionError(f"not {num_replicas} healthy replica(s) within {timeout}s: {self.replicas()}\n"
                             + self.text()[-4000:])

    def admin(self) -> tuple[str, str]:
        """(URL, key) from serve's admin file."""
        (path,) = (self.cache / "admin").glob("serve-*.json")
        entry = json.loads(path.read_text())
        return entry["url"], entry["key"]

    def call(self, method: str, path: str, body: dict | None = None, key: str | None = None) -> requests.Response:
        url, real_key = self.admin()
        headers = {} if key == "" else {"Authorization": f"Bearer {real_key if key is None else key}"}
        return requests.request(method, url + path, json=body, headers=headers, timeout=10)

    def wait_operation(self, op_id: str, timeout: float = 240, until=None) -> dict:
        """The operation once it ended (or once until(op) holds)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            status = self.call("GET", "/admin/status").json()
            op = next(o for o in (status["operation"], status["last_operation"]) if o and o["id"] == op_id)
            if (until is not None and until(op)) or (until is None and op["state"] != "running"):
                return op
            time.sleep(0.05)
        raise AssertionError(f"operation {op_id} still running after {timeout}s:\n{self.text()[-4000:]}")

    def pids(self) -> list[int]:
        return [int(p) for p in re.findall(r"started \S+ \(pid (\d+)\)", self.text())]

    def pid(self, child: str) -> int:
        """The last process started for a child (e.g. "scheduler[1]")."""
        return int(re.findall(rf"started {re.escape(child)} \(pid (\d+)\)", self.text())[-1])

    def stop(self, timeout: float = 90) -> int:
        """SIGTERM: serve drains and exits 0, no child left behind."""
        pids = self.pids()
        self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(timeout=timeout)
        assert code == 0, self.text()[-4000:]
        left = [p for p in pids if alive(p)]
        assert left == [], f"children left: {left}"
        return code


class Load:
    """`clients` threads, each streaming the prompts in turn until stop(); every answer checked."""

    def __init__(self, base_urls: list[str], model: str, batch: list[list[int]], want: list[list[int]],
                 max_tokens: int, clients: int):
        self.urls, self.batch, self.want, self.clients = base_urls, batch, want, clients
        self.body = lambda p: {"model": model, "prompt": p, "max_tokens": max_tokens, "temperature": 0,  # noqa: E731
                               "ignore_eos": True, "stream": True, "return_token_ids": True}
        self.stopping = threading.Event()
        self.answers: list[tuple[int, list[int], list[str], int]] = []  # prompt, tokens, finish reasons, resumes
        self.errors: list[str] = []
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._client, args=(c,), daemon=True) for c in range(clients)]

    def __enter__(self) -> "Load":
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _client(self, c: int) -> None:
        n = 0
        while not self.stopping.is_set():
            i = (c + n) % len(self.batch)
            try:
                out = stream(self.urls, "/v1/completions", self.body(self.batch[i]), f"load-{c}-{n}", timeout=180)
                with self.lock:
                    self.answers.append((i, out.token_ids, out.finish_reasons, out.resumes))
            except Exception as err:  # noqa: BLE001 - every failure is a lost request, reported by check()
                with self.lock:
                    self.errors.append(f"client {c} request {n}: {err}")
            n += 1

    def wait_answers(self, n: int, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while len(self.answers) < n:
            assert time.monotonic() < deadline and not self.errors, (len(self.answers), self.errors[:3])
            time.sleep(0.05)

    def stop(self) -> None:
        self.stopping.set()
        for t in self.threads:
            t.join(timeout=180)

    def check(self) -> int:
        """Every answer complete and token-exact, no request lost; returns the number of answers."""
        assert not self.errors, self.errors[:5]
        for i, tokens, reasons, _ in self.answers:
            assert tokens == self.want[i] and reasons == ["length"], (i, tokens, self.want[i])
        return len(self.answers)


def scrape(base_url: str) -> dict[str, float]:
    lines = requests.get(f"{base_url}/metrics", timeout=10).text.splitlines()
    return {k: float(v) for k, v in (line.rsplit(" ", 1) for line in lines if line and not line.startswith("#"))}
