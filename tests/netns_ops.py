"""serve's operations driven inside a network namespace, where its router and admin API are (tests/test_ray.py):
looping streamed load (ops_mesh.Load, every answer checked token-exact against transformers' tokens), the admin
API's calls, and the `stagemesh scale` / `stagemesh rollout` commands."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from netns import clean_env

TESTS = Path(__file__).parent
ROOT = TESTS.parent

# Runs inside the namespace: `clients` threads stream the prompts over and over (resuming a cut stream with
# Last-Event-ID); prints STARTED once each client has an answer; on a line on stdin, waits for `clients` answers
# more, stops, and prints one JSON line: the answers and resumed streams, or what was wrong.
LOAD = r"""
import json, sys
sys.path[:0] = [sys.argv[1], sys.argv[2]]
from ops_mesh import Load
base, model, batch, want, max_tokens, clients = json.loads(sys.argv[3])
load = Load([base], model, batch, want, max_tokens, clients)
try:
    with load:
        load.wait_answers(clients, timeout=120)
        print("STARTED", flush=True)
        sys.stdin.readline()
        load.wait_answers(len(load.answers) + clients, timeout=120)
    print(json.dumps({"answered": load.check(), "resumed": sum(a[3] for a in load.answers)}), flush=True)
except AssertionError as err:
    print("NOT STARTED" if not load.answers else "", flush=True)
    print(json.dumps({"error": str(err)[:3000]}), flush=True)
"""

ADMIN = r"""
import json, sys
from stagemesh.entry.ops import admin_client, admin_file
url, key = admin_file.discover(None, None)
print(json.dumps(admin_client.call(url, key, *json.loads(sys.argv[1]))))
"""


class NetnsLoad:
    def __init__(self, host, base_url: str, model: str, batch: list, want: list, max_tokens: int, clients: int):
        spec = json.dumps([base_url, model, batch, want, max_tokens, clients])
        self.proc = subprocess.Popen(host.argv(sys.executable, "-c", LOAD, str(TESTS), str(ROOT), spec),
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=clean_env())

    def __enter__(self) -> "NetnsLoad":
        line = self.proc.stdout.readline().strip()
        assert line == "STARTED", line + self.proc.stdout.read()
        return self

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def finish(self, timeout: float = 180) -> dict:
        """Stop once every client answered once more; {"answered": n, "resumed": k} (every answer token-exact, none
        lost) or {"error": ...}."""
        out, _ = self.proc.communicate("stop\n", timeout=timeout)
        return json.loads(out.strip().splitlines()[-1])


def admin(host, env: dict, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
    """(status, JSON body) of one admin API call made inside the namespace (serve's admin file gives URL and key)."""
    done = subprocess.run(host.argv(sys.executable, "-c", ADMIN, json.dumps([method, path, body])), cwd=ROOT,
                          capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    status, answer = json.loads(done.stdout.strip().splitlines()[-1])
    return status, answer


def command(host, env: dict, *argv: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """`stagemesh <argv>` run inside the namespace (it finds serve's admin API in the stagemesh cache)."""
    return subprocess.run(host.argv(sys.executable, "-m", "stagemesh", *argv), cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, env=env)
