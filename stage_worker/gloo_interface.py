"""The network interface gloo binds on a Ray node: the one that holds the node's Ray address.

Without GLOO_SOCKET_IFNAME, gloo binds the address the host's name resolves to. Where the name maps to
127.0.1.1 (Debian's and Ubuntu's /etc/hosts) that is loopback: stages on other nodes never reach it and the
pipeline never forms, without a word. On Ray the node's address is known (the actor that runs the stage passes
it in HOST_IP_ENV, as vLLM's VLLM_HOST_IP), so a stage binds gloo to the interface that holds it, or refuses.
A GLOO_SOCKET_IFNAME the user set always wins.
"""
from __future__ import annotations

import ipaddress
import logging
import os
import socket

from stagemesh.core.errors import StagemeshError

log = logging.getLogger("stagemesh.stage")
HOST_IP_ENV = "STAGEMESH_HOST_IP"  # the address of the node this service runs on (set under Ray)


def local_interfaces() -> dict[str, list[str]]:
    """This host's interfaces and their IPv4 / IPv6 addresses."""
    import psutil

    families = (socket.AF_INET, socket.AF_INET6)
    return {name: [a.address for a in addrs if a.family in families] for name, addrs in psutil.net_if_addrs().items()}


def _ip(text: str):
    try:
        return ipaddress.ip_address(text.split("%", 1)[0])  # (an IPv6 link-local address carries its scope)
    except ValueError:
        return None


def interface_holding(node_ip: str, interfaces: dict[str, list[str]]) -> str:
    """The interface that holds node_ip; StagemeshError naming GLOO_SOCKET_IFNAME when none does."""
    want = _ip(node_ip)
    for name, addresses in sorted(interfaces.items()):
        if want is not None and any(_ip(a) == want for a in addresses):
            return name
    held = "; ".join(f"{name} {', '.join(a)}" for name, a in sorted(interfaces.items()) if a) or "none"
    raise StagemeshError(f"no network interface of this host holds its Ray node address {node_ip} (interfaces: "
                         f"{held}), so gloo cannot be bound to it: set GLOO_SOCKET_IFNAME to the interface the other "
                         "nodes reach this one on")


def hostname_address() -> str | None:
    """The address this host's name resolves to (what gloo binds by default), or None."""
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return None


def choose_gloo_interface(node_ip: str, interfaces: dict[str, list[str]], hostname_ip: str | None) -> tuple[str, str]:
    """(GLOO_SOCKET_IFNAME for a node whose Ray address is node_ip, the log line that says why)."""
    name = interface_holding(node_ip, interfaces)
    why = f"the interface of this node's Ray address {node_ip}"
    resolved = _ip(hostname_ip) if hostname_ip else None
    if resolved is not None and resolved.is_loopback and not _ip(node_ip).is_loopback:
        why += f"; this host's name resolves to {hostname_ip}, which gloo would bind otherwise"
    return name, f"GLOO_SOCKET_IFNAME={name} ({why})"


def configure_gloo_interface(env=os.environ) -> None:
    """Under Ray (HOST_IP_ENV set) and without the user's GLOO_SOCKET_IFNAME: set it, for this process and
    the TP followers it starts, and log it."""
    node_ip = env.get(HOST_IP_ENV)
    if not node_ip or env.get("GLOO_SOCKET_IFNAME"):
        return
    name, line = choose_gloo_interface(node_ip, local_interfaces(), hostname_address())
    env["GLOO_SOCKET_IFNAME"] = name
    log.info("%s", line)
