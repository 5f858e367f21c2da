"""The commands' side of serve's admin API (stagemesh rollout, stagemesh scale): find it, call it, and follow
the operation it started until it ends, printing each step."""
from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.request

from stagemesh.core.errors import StagemeshError
from stagemesh.entry.ops import admin_file

CALL_TIMEOUT_S = 10.0
POLL_S = 1.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--admin-url", default=None, metavar="URL",
                   help=f"serve's admin API (default: ${admin_file.ENV_URL}, else the one serve running on this host)")
    p.add_argument("--admin-api-key", default=None, metavar="KEY",
                   help=f"its key (default: ${admin_file.ENV_KEY}, else the key serve generated, from its admin file)")
    p.add_argument("--timeout", type=float, default=3600.0, metavar="SECONDS",
                   help="stop following the operation after this long (it goes on in serve; default 3600)")
    p.add_argument("--no-wait", action="store_true", help="start the operation and return")


def call(url: str, key: str, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url + path, data=data, method=method, headers={
        "Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=CALL_TIMEOUT_S) as resp:
            return resp.status, json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as err:
        try:
            return err.code, json.loads(err.read() or b"{}")
        except ValueError:
            return err.code, {"error": {"message": err.reason}}
    except (urllib.error.URLError, OSError) as err:
        raise StagemeshError(f"the admin API at {url} does not answer: {getattr(err, 'reason', err)}") from None


def start(args: argparse.Namespace, path: str, body: dict) -> int:
    """POST the operation, then follow it (unless --no-wait); the command's exit code."""
    url, key = admin_file.discover(args.admin_url, args.admin_api_key)
    status, answer = call(url, key, "POST", path, body)
    if status >= 400:
        raise StagemeshError(f"HTTP {status}: {answer.get('error', {}).get('message', answer)}")
    op = answer.get("operation")
    if op is None:
        print("nothing to do: the mesh already has that many replicas")
        return 0
    print(f"operation {op['id']}: {op['description']} ({op['steps_total']} steps)", flush=True)
    return 0 if args.no_wait else follow(url, key, op["id"], args.timeout)


def follow(url: str, key: str, op_id: str, timeout: float) -> int:
    """Print the operation's steps as they come; 0 when it succeeded, 1 when it failed or was cancelled."""
    deadline, said = time.monotonic() + timeout, ""
    while time.monotonic() < deadline:
        status, body = call(url, key, "GET", "/admin/status")
        if status != 200:
            raise StagemeshError(f"GET /admin/status: HTTP {status}")
        op = next((o for o in (body.get("operation"), body.get("last_operation")) if o and o["id"] == op_id), None)
        if op is None:
            raise StagemeshError(f"serve no longer reports operation {op_id}")
        line = f"[{op['steps_done']}/{op['steps_total']}] {op['step'] or ''}" + \
            (f": waiting for {op['waiting_for']}" if op["waiting_for"] else "")
        if line != said and op["state"] == "running":
            print(line, flush=True)
            said = line
        if op["state"] != "running":
            print(f"operation {op_id} {op['state']}" + (f": {op['error']}" if op["error"] else ""), flush=True)
            return 0 if op["state"] == "succeeded" else 1
        time.sleep(POLL_S)
    print(f"still running after {timeout:.0f}s (GET {url}/admin/status follows it)", file=sys.stderr)
    return 1
