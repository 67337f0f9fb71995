"""Which address and interface a node's ranks talk to the other nodes from.

Gloo, NCCL and NVSHMEM's bootstrap each pick an interface of their own when told none, and gloo
picks the address the host name resolves to: on many Debian/Ubuntu machines that is loopback
(127.0.1.1 in /etc/hosts), so gloo tells the other nodes to connect to 127.0.0.1 and the launch
never joins. The address certain to reach node 0 is the one the kernel routes to it from, so each
node asks the kernel for it (a UDP socket `connect`ed to the master: a route lookup, no packet
sent), finds the interface holding it, and names that interface to all three. What the user
chose (`--node-ip`, `GLOO_SOCKET_IFNAME`, `NCCL_SOCKET_IFNAME`) wins; a single-node launch is
left exactly as it was.
"""

from __future__ import annotations

import fcntl
import ipaddress
import logging
import os
import socket
import struct
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass

from moeserve.config import ParallelConfig

logger = logging.getLogger(__name__)

GLOO_VAR = "GLOO_SOCKET_IFNAME"
NCCL_VAR = "NCCL_SOCKET_IFNAME"
IFNAME_VARS = (GLOO_VAR, NCCL_VAR, "NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME")
"""Where each library reads the interface its sockets use (NVSHMEM: its UID bootstrap)."""
_SIOCGIFADDR = 0x8915


@dataclass(frozen=True)
class NodeNetwork:
    address: str
    """This node's address as the other nodes reach it."""
    interface: str
    chosen_by: str
    """How: the route to node 0, --node-ip, or the user's GLOO_SOCKET_IFNAME."""

    def variables(self, environ: Mapping[str, str]) -> dict[str, str]:
        """The interface variables to export: every one the user left unset."""
        return {name: self.interface for name in IFNAME_VARS if not environ.get(name, "").strip()}


def route_address(host: str, port: int) -> str:
    """The local address the kernel sends from to reach `host` (resolved as the ranks resolve it)."""
    family, _, _, _, target = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(target)
        return probe.getsockname()[0]


def _ipv4_address(interface: str) -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            answer = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", interface.encode()[:15]))
        except OSError:  # no IPv4 address on it
            return None
    return socket.inet_ntoa(answer[20:24])


def _ipv6_addresses() -> dict[str, list[str]]:
    """Interface -> its IPv6 addresses, from the kernel's table (absent where IPv6 is off)."""
    found: dict[str, list[str]] = {}
    try:
        lines = open("/proc/net/if_inet6").read().splitlines()
    except OSError:
        return found
    for line in lines:
        fields = line.split()
        hexed, name = fields[0], fields[-1]
        found.setdefault(name, []).append(str(ipaddress.IPv6Address(bytes.fromhex(hexed))))
    return found


def interface_addresses() -> dict[str, list[str]]:
    """Every interface -> its addresses, read from the kernel (no `ip` binary needed)."""
    v6 = _ipv6_addresses()
    table = {}
    for _, name in socket.if_nameindex():
        v4 = _ipv4_address(name)
        table[name] = ([v4] if v4 else []) + v6.get(name, [])
    return table


def interface_of(address: str) -> str | None:
    wanted = ipaddress.ip_address(address)
    for name, addresses in interface_addresses().items():
        if any(ipaddress.ip_address(a) == wanted for a in addresses):
            return name
    return None


def _means_this_machine(host: str) -> bool:
    """Whether the user put every node on this machine (the master given as loopback)."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def choose_node_network(parallel: ParallelConfig, environ: Mapping[str, str]) -> NodeNetwork | None:
    """This node's address and interface for a multi-node launch (None on one node). Raises
    ValueError, naming the fix, where the choice cannot work."""
    if parallel.nnodes == 1:
        return None
    user_interface = environ.get(GLOO_VAR, "").split(",")[0].strip()
    if parallel.node_ip:
        interface = interface_of(parallel.node_ip)
        if interface is None:
            raise ValueError(f"--node-ip {parallel.node_ip} is not an address of any interface of this machine")
        network = NodeNetwork(parallel.node_ip, interface, "--node-ip")
    elif user_interface:
        addresses = interface_addresses().get(user_interface)
        if not addresses:
            raise ValueError(f"{GLOO_VAR}={user_interface} names no interface with an address on this machine")
        network = NodeNetwork(addresses[0], user_interface, f"${GLOO_VAR}")
    else:
        address = route_address(parallel.master_addr, parallel.master_port)
        interface = interface_of(address)
        if interface is None:
            raise ValueError(
                f"the route to --master-addr {parallel.master_addr} leaves from {address}, which no interface "
                f"holds: set {GLOO_VAR} and {NCCL_VAR} to the interface the nodes reach each other on, or --node-ip"
            )
        network = NodeNetwork(address, interface, f"the route to {parallel.master_addr}")
    if ipaddress.ip_address(network.address).is_loopback and not _means_this_machine(parallel.master_addr):
        why = (
            f"--master-addr {parallel.master_addr} resolves to this machine's loopback here (a host name listed as "
            "127.0.1.1 in /etc/hosts does)"
            if network.chosen_by.startswith("the route")
            else "the other nodes cannot reach it"
        )
        raise ValueError(
            f"node {parallel.node_rank} would talk to the other nodes from loopback address {network.address} "
            f"({network.interface}, chosen by {network.chosen_by}): {why}. Give --master-addr as node 0's address "
            f"that every node reaches (e.g. its IP), and choose this node's address with --node-ip (or "
            f"{GLOO_VAR}/{NCCL_VAR}) where the route to it is not the one"
        )
    return network


def use_node_network(parallel: ParallelConfig, environ: MutableMapping[str, str] = os.environ) -> NodeNetwork | None:
    """Choose this node's network and export the interface variables its ranks inherit (a rank
    process takes the environment at its start); logged, for the operator to check."""
    network = choose_node_network(parallel, environ)
    if network is None:
        return None
    exported = network.variables(environ)
    environ.update(exported)
    kept = [f"{name}={environ[name]}" for name in IFNAME_VARS if name not in exported]
    logger.info(
        "node %d talks to the other nodes from %s on interface %s (chosen by %s); exported %s%s",
        parallel.node_rank,
        network.address,
        network.interface,
        network.chosen_by,
        ", ".join(exported) or "nothing",
        f"; kept the user's {', '.join(kept)}" if kept else "",
    )
    return network
