"""On a Ray node a stage binds gloo to the interface that holds the node's Ray address (GLOO_SOCKET_IFNAME, logged),
or refuses naming GLOO_SOCKET_IFNAME: checked against this host's real interfaces, and with a real stage process."""
from __future__ import annotations

import ipaddress
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from stagemesh.core.errors import StagemeshError
from stage_worker.gloo_interface import HOST_IP_ENV, choose_gloo_interface, interface_holding, local_interfaces


def _addresses() -> list[tuple[str, str]]:
    return [(name, address) for name, addresses in local_interfaces().items() for address in addresses]


def _not_here() -> str:
    """A documentation address (RFC 5737) on no interface of this host."""
    held = {ipaddress.ip_address(a.split("%")[0]) for _, a in _addresses()}
    return next(str(ip) for ip in ipaddress.ip_network("198.51.100.0/24").hosts() if ip not in held)


def _routable() -> tuple[str, str]:
    found = [(n, a) for n, a in _addresses() if ":" not in a and not ipaddress.ip_address(a).is_loopback]
    if not found:
        pytest.skip("this host has no non-loopback IPv4 address")
    return found[0]


def test_the_interface_chosen_for_each_local_address_holds_it():
    interfaces = local_interfaces()
    assert interfaces and any(interfaces.values())
    for _, address in _addresses():
        chosen = interface_holding(address, interfaces)
        assert address in interfaces[chosen], (address, chosen, interfaces)


def test_a_hostname_on_127_0_1_1_does_not_make_gloo_bind_loopback():
    name, address = _routable()
    chosen, line = choose_gloo_interface(address, local_interfaces(), hostname_ip="127.0.1.1")
    assert chosen == name and chosen != "lo"
    assert line.startswith(f"GLOO_SOCKET_IFNAME={name} (the interface of this node's Ray address {address}")
    assert "resolves to 127.0.1.1" in line


def test_a_node_address_on_no_interface_is_refused_naming_gloo_socket_ifname():
    address = _not_here()
    with pytest.raises(StagemeshError) as err:
        choose_gloo_interface(address, local_interfaces(), hostname_ip="127.0.1.1")
    assert f"its Ray node address {address}" in str(err.value) and "set GLOO_SOCKET_IFNAME" in str(err.value)


def _stage(tiny_model_dir, host_ip: str, log_path):
    env = {k: v for k, v in os.environ.items() if k != "GLOO_SOCKET_IFNAME"}
    with open(log_path, "wb") as log:
        return subprocess.Popen([sys.executable, "-m", "stagemesh", "stage", str(tiny_model_dir("llama")),
                                 "--stage-index", "0", "--layers", "0:4", "-tp", "2", "--scheduler", "127.0.0.1:9",
                                 "--port", "0", "--device", "cpu"],
                                env={**env, HOST_IP_ENV: host_ip}, stdout=log, stderr=subprocess.STDOUT)


@pytest.mark.slow
def test_a_stage_on_a_ray_node_logs_its_gloo_interface_or_refuses(tiny_model_dir, tmp_path):
    name, address = _routable()
    nowhere = _not_here()
    log_path, refused_log = tmp_path / "stage.log", tmp_path / "refused.log"
    proc, refused = _stage(tiny_model_dir, address, log_path), _stage(tiny_model_dir, nowhere, refused_log)
    try:
        want = f"GLOO_SOCKET_IFNAME={name} (the interface of this node's Ray address {address}"
        deadline = time.monotonic() + 60
        while want not in log_path.read_text() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert want in log_path.read_text(), log_path.read_text()
        # the stage's TP follower (another gloo rank) is started with it in its environment
        stage = psutil.Process(proc.pid)
        while not (followers := [c for c in stage.children() if "stage_worker.follower" in c.cmdline()]):
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.2)
        assert followers[0].environ().get("GLOO_SOCKET_IFNAME") == name
        assert refused.wait(timeout=60) == 2
    finally:
        for p in (proc, refused):
            p.send_signal(signal.SIGTERM)
        for p in (proc, refused):
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    out = refused_log.read_text()
    assert f"stagemesh stage: error: no network interface of this host holds its Ray node address {nowhere}" in out
    assert "set GLOO_SOCKET_IFNAME" in out and "Traceback" not in out, out


# one rank of a two-rank gloo world, one per "host"; with --pick, the stage's choice of interface first
GLOO_RANK = """
import sys
from datetime import timedelta
import torch, torch.distributed as dist
rank, master, port, pick = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4] == "--pick"
wait = timedelta(seconds=int(sys.argv[5]))
if pick:
    import logging
    from stage_worker.gloo_interface import configure_gloo_interface
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    configure_gloo_interface()
store = dist.TCPStore(master, port, world_size=2, is_master=rank == 0, timeout=wait)
dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=wait)
total = torch.tensor([rank + 1.0])
dist.all_reduce(total)
print("sum", total.item(), flush=True)
dist.destroy_process_group()  # left to interpreter exit, gloo's threads may abort it ("terminate called ...")
"""


@pytest.mark.slow
def test_gloo_between_two_hosts_whose_names_map_to_127_0_1_1_forms_on_the_ray_address(tmp_path):
    """Two network namespaces on one segment, each host's name mapped to 127.0.1.1 in its /etc/hosts (as Debian
    does): gloo's own choice is loopback and the world never forms; with the stage's choice it does."""
    from pathlib import Path

    from netns import NetnsPair, NetnsUnavailable, clean_env

    pair = NetnsPair(subnet="10.79.0", tag=f"g{os.getpid()}")
    try:
        pair.__enter__()
    except NetnsUnavailable as err:
        pytest.skip(f"cannot make network namespaces: {err}")
    try:
        pair.map_hostname("127.0.1.1")
        repo = str(Path(__file__).parents[1])
        procs = {}

        def spawn(variant: str, port: int, wait_s: int) -> None:
            for rank, host in enumerate(pair.hosts):
                env = {k: v for k, v in clean_env(PYTHONPATH=repo, OMP_NUM_THREADS="1",
                                                  **{HOST_IP_ENV: host.address}).items() if k != "GLOO_SOCKET_IFNAME"}
                procs[variant, rank] = host.spawn(
                    [sys.executable, "-c", GLOO_RANK, str(rank), pair.a.address, str(port), variant, str(wait_s)],
                    env, tmp_path / f"{variant[2:]}-{rank}.log")

        # one world at a time, and a wait that a loaded machine's two torch imports fit in: the ranks must meet
        spawn("--pick", 29611, 60)
        codes = {key: procs[key].wait(timeout=90) for key in (("--pick", 0), ("--pick", 1))}
        spawn("--gloo-default", 29612, 8)
        deadline = time.monotonic() + 15  # by now a world that could form would have formed
        for key in (("--gloo-default", 0), ("--gloo-default", 1)):
            try:
                codes[key] = procs[key].wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                procs[key].kill()
                codes[key] = procs[key].wait()
        logs = {key: (tmp_path / f"{key[0][2:]}-{key[1]}.log").read_text() for key in procs}
        for rank, host in enumerate(pair.hosts):
            assert codes["--pick", rank] == 0 and "sum 3.0" in logs["--pick", rank], logs
            assert (f"GLOO_SOCKET_IFNAME={host.ifname} (the interface of this node's Ray address {host.address}; "
                    "this host's name resolves to 127.0.1.1") in logs["--pick", rank]
        # the scenario is the issue's: left to itself, gloo binds loopback and the world does not form
        assert not any("sum" in logs["--gloo-default", rank] for rank in (0, 1)), logs
    finally:
        pair.__exit__()
