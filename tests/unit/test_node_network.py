"""A node's address and interface across nodes: found from the route to node 0, or the user's."""

from __future__ import annotations

import pytest

from moeserve.config import ParallelConfig
from moeserve.distributed import node_network
from moeserve.distributed.node_network import IFNAME_VARS, choose_node_network, use_node_network


def layout(**kw: object) -> ParallelConfig:
    return ParallelConfig(**{"ep": 2, "nnodes": 2, "master_port": 29555, **kw})  # type: ignore[arg-type]


def test_one_node_is_left_as_it_was() -> None:
    environ: dict[str, str] = {}
    assert use_node_network(ParallelConfig(ep=4), environ) is None
    assert environ == {}


def test_the_route_to_the_master_names_the_interface_and_the_user_variables_are_kept() -> None:
    environ = {"NCCL_SOCKET_IFNAME": "^docker"}
    network = use_node_network(layout(master_addr="127.0.0.1", node_rank=1), environ)
    assert network is not None and network.address == "127.0.0.1" and network.interface == "lo"
    assert network.chosen_by == "the route to 127.0.0.1"
    assert environ == {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "^docker", IFNAME_VARS[2]: "lo"}


def test_node_ip_and_gloo_socket_ifname_win_over_the_route() -> None:
    by_ip = choose_node_network(layout(master_addr="127.0.0.1", node_ip="127.0.0.1"), {})
    assert by_ip is not None and (by_ip.interface, by_ip.chosen_by) == ("lo", "--node-ip")
    by_var = choose_node_network(layout(master_addr="127.0.0.1"), {"GLOO_SOCKET_IFNAME": "lo"})
    assert by_var is not None and (by_var.address, by_var.chosen_by) == ("127.0.0.1", "$GLOO_SOCKET_IFNAME")
    with pytest.raises(ValueError, match="not an address of any interface"):
        choose_node_network(layout(node_ip="192.0.2.77"), {})
    with pytest.raises(ValueError, match=r"from loopback address 127\.0\.0\.1 .*the other nodes cannot reach it"):
        choose_node_network(layout(master_addr="10.200.0.1", node_ip="127.0.0.1"), {})
    with pytest.raises(ValueError, match="names no interface"):
        choose_node_network(layout(), {"GLOO_SOCKET_IFNAME": "nosuch0"})


def test_a_master_name_that_resolves_to_loopback_is_refused_with_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    # As on a Debian host whose /etc/hosts lists its own name as 127.0.1.1.
    monkeypatch.setattr(node_network, "route_address", lambda host, port: "127.0.1.1")
    monkeypatch.setattr(node_network, "interface_of", lambda address: "lo")
    with pytest.raises(ValueError, match=r"loopback address 127\.0\.1\.1 .*--master-addr hosta .*--node-ip"):
        choose_node_network(layout(master_addr="hosta"), {})
    # Every node on this machine, as the user asked: loopback is right.
    assert choose_node_network(layout(master_addr="localhost"), {}) is not None


def test_a_node_ip_must_be_an_address() -> None:
    with pytest.raises(ValueError):
        layout(node_ip="node-a")
