"""Network namespaces on one Ethernet segment: several "hosts" on one machine, for multi-node tests.

Needs root (or CAP_NET_ADMIN + CAP_SYS_ADMIN) and iproute2's `ip`; :class:`NetnsUnavailable`
says why when they are missing, so that a test can skip. On exit, even after a failure, every
process started through :meth:`Host.spawn` is stopped, every other process still in a namespace
(daemons such as `ray start`'s) is killed, and the namespaces are deleted.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

# Variables that would send traffic somewhere else than the namespaces' own addresses.
_DROPPED_ENV = ("http_proxy", "https_proxy", "all_proxy", "grpc_proxy", "no_proxy")


class NetnsUnavailable(RuntimeError):
    """Network namespaces cannot be made here (not root, no `ip`, EPERM...)."""


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k.lower() not in _DROPPED_ENV and not k.startswith("OTEL_")}
    env.update(extra)
    return env


@dataclass
class Host:
    """One namespace: its name, its veth interface and its address."""
    netns: str
    ifname: str
    address: str
    procs: list[subprocess.Popen] = field(default_factory=list)

    def argv(self, *argv: str) -> list[str]:
        return ["ip", "netns", "exec", self.netns, *argv]

    def spawn(self, argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
        """Start argv inside the namespace (`ip netns exec` execs it: the pid is the program's own)."""
        with open(log, "ab") as out:
            proc = subprocess.Popen(self.argv(*argv), stdout=out, stderr=subprocess.STDOUT, env=env,
                                    stdin=subprocess.DEVNULL)
        self.procs.append(proc)
        return proc

    def http(self, method: str, url: str, body: dict | None = None, timeout: float = 10) -> tuple[int, object]:
        """(status, JSON body or text) of one HTTP request made from inside the namespace; status 0: no answer."""
        code = (
            "import json, sys, urllib.request, urllib.error\n"
            "method, url, body, timeout = json.loads(sys.argv[1])\n"
            "opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))\n"
            "data = None if body is None else json.dumps(body).encode()\n"
            "req = urllib.request.Request(url, data=data, method=method,\n"
            "                             headers={'Content-Type': 'application/json'})\n"
            "try:\n"
            "    resp = opener.open(req, timeout=timeout); status, text = resp.status, resp.read().decode()\n"
            "except urllib.error.HTTPError as err:\n"
            "    status, text = err.code, err.read().decode()\n"
            "except OSError as err:\n"
            "    status, text = 0, repr(err)\n"
            "print(json.dumps([status, text]))\n"
        )
        args = json.dumps([method, url, body, timeout])
        try:
            done = subprocess.run(self.argv(sys.executable, "-c", code, args), capture_output=True, text=True,
                                  timeout=timeout + 15, env=clean_env())
        except subprocess.TimeoutExpired:
            return 0, f"no answer from {url} in {timeout}s"
        if done.returncode != 0:
            return 0, done.stderr.strip()[-2000:]
        status, text = json.loads(done.stdout.strip().splitlines()[-1])
        try:
            return status, json.loads(text)
        except ValueError:
            return status, text

    def pids(self) -> list[int]:
        """Every process in the namespace, whoever started it."""
        done = subprocess.run(["ip", "netns", "pids", self.netns], capture_output=True, text=True, timeout=30)
        return [int(p) for p in done.stdout.split()]

    def kill_everything(self) -> None:
        """SIGKILL every process in the namespace: the host drops off the network as a crashed machine would."""
        for pid in self.pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def stop_all(self, timeout: float = 10) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + timeout
        for proc in self.procs:
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise NetnsUnavailable(f"`ip {' '.join(args)}` failed: {done.stderr.strip() or done.returncode}")


class NetnsLan:
    """`size` namespaces on one Ethernet segment: a bridge in a namespace of its own, each host's veth
    plugged into it, host i at {subnet}.{i+1}/24 (names unique per pid)."""

    def __init__(self, size: int, subnet: str = "10.77.0", tag: str | None = None):
        tag = tag or str(os.getpid())
        self.hosts = [Host(f"sm{i}{tag}", f"smv{i}{tag}"[:15], f"{subnet}.{i + 1}") for i in range(size)]
        self.switch = f"smS{tag}"
        self._made: list[str] = []
        self._etc: list[Path] = []  # per-namespace /etc files (map_hostname)
        self._made_etc_root = False

    def __enter__(self):
        if shutil.which("ip") is None:
            raise NetnsUnavailable("iproute2's `ip` command is missing (apt-get install iproute2)")
        if os.geteuid() != 0:
            raise NetnsUnavailable(f"network namespaces need root; running as uid {os.geteuid()}")
        try:
            for name in [self.switch, *(h.netns for h in self.hosts)]:
                _ip("netns", "add", name)
                self._made.append(name)
            _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "br0", "up")
            for i, host in enumerate(self.hosts):
                port = f"smp{i}"  # the switch's end, inside the switch's namespace
                _ip("link", "add", host.ifname, "type", "veth", "peer", "name", port, "netns", self.switch)
                _ip("-n", self.switch, "link", "set", port, "master", "br0")
                _ip("-n", self.switch, "link", "set", port, "up")
                _ip("link", "set", host.ifname, "netns", host.netns)
                _ip("-n", host.netns, "addr", "add", f"{host.address}/24", "dev", host.ifname)
                _ip("-n", host.netns, "link", "set", host.ifname, "up")
                _ip("-n", host.netns, "link", "set", "lo", "up")
        except BaseException:
            self.__exit__()
            raise
        return self

    def map_hostname(self, address: str) -> None:
        """In every namespace this machine's host name resolves to `address` (e.g. Debian's 127.0.1.1): an
        /etc/netns/NAME/hosts, which `ip netns exec` mounts over /etc/hosts for what it runs."""
        import socket

        root = Path("/etc/netns")
        self._made_etc_root = self._made_etc_root or not root.exists()
        for host in self.hosts:
            folder = root / host.netns
            folder.mkdir(parents=True, exist_ok=True)
            self._etc.append(folder)
            (folder / "hosts").write_text(f"127.0.0.1 localhost\n{address} {socket.gethostname()}\n")

    def __exit__(self, *exc) -> None:
        for folder in self._etc:
            shutil.rmtree(folder, ignore_errors=True)
        self._etc.clear()
        if self._made_etc_root:
            try:
                Path("/etc/netns").rmdir()
            except OSError:  # other namespaces' files are there now
                pass
        for host in self.hosts:
            host.stop_all()
            if host.netns in self._made:
                host.kill_everything()
        for name in self._made:  # deleting a namespace deletes the veth ends inside it, and so the pairs
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
        self._made.clear()
        for host in self.hosts:  # a veth pair that never reached its namespaces is still in ours
            subprocess.run(["ip", "link", "del", host.ifname], capture_output=True, timeout=30)


class NetnsPair(NetnsLan):
    """Two hosts, A at 10.77.0.1/24 and B at 10.77.0.2/24."""

    def __init__(self, subnet: str = "10.77.0", tag: str | None = None):
        super().__init__(2, subnet, tag)
        self.a, self.b = self.hosts
