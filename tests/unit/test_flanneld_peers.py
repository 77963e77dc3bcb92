"""Paths to flanneld peers: they decide DirectRouting alone, from the network config's
own Backend (their leases cannot say, and they read no per-node override), so both
ends of every pair take the same path; and a peer of a backend we do not speak is
reported, never routed."""

from __future__ import annotations

import json
from ipaddress import IPv4Address, IPv4Network

import pytest

from flannelpy.backend.base import NodeContext
from flannelpy.backend.registry import get_backend
from flannelpy.control.change import wanted_config
from flannelpy.control.records import NodeOverride
from flannelpy.dataplane.state import DesiredState, Route
from flannelpy.subnet.lease import Lease, LeaseAttrs
from tests.support.fakes import underlay

OWN_MAC, PEER_MAC = "02:00:00:00:00:01", "02:00:00:00:00:02"
OWN = Lease(
    IPv4Network("10.244.1.0/24"),
    LeaseAttrs(IPv4Address("192.168.1.10"), "vxlan", {"VNI": 1, "VtepMAC": OWN_MAC}, mtu=1450),
)
PEER_SUBNET = IPv4Network("10.244.2.0/24")
ON_LINK = "192.168.1.20"


def config_doc(direct_routing: bool) -> bytes:
    backend = {"Type": "vxlan", "DirectRouting": direct_routing}
    return json.dumps({"Network": "10.244.0.0/16", "Backend": backend}).encode()


def ctx_for(cluster_dr: bool, own_dr: bool | None) -> NodeContext:
    """This node under a network config with ``cluster_dr``; ``own_dr`` not None: this
    node runs an override of it with that DirectRouting."""
    override = (
        None
        if own_dr is None
        else NodeOverride({"Type": "vxlan", "DirectRouting": own_dr}, generation=1)
    )
    config = wanted_config(config_doc(cluster_dr), override)
    return NodeContext(
        config=config,
        underlay=underlay("192.168.1.10"),
        public_ip=IPv4Address("192.168.1.10"),
        node_name="node-a",
    )


def flanneld_peer(ip: str = ON_LINK, backend: str = "vxlan") -> Lease:
    """A lease as flanneld writes it: no Flannelpy extension."""
    data = {"VNI": 1, "VtepMAC": PEER_MAC} if backend == "vxlan" else {"PublicKey": "x"}
    return Lease(PEER_SUBNET, LeaseAttrs(IPv4Address(ip), backend, data))


def our_peer(direct_routing: bool, ip: str = ON_LINK) -> Lease:
    return Lease(
        PEER_SUBNET,
        LeaseAttrs(
            IPv4Address(ip),
            "vxlan",
            {"VNI": 1, "VtepMAC": PEER_MAC},
            node_name="n2",
            mtu=1450,
            direct_routing=True if direct_routing else None,
        ),
    )


def plan(ctx: NodeContext, peer: Lease) -> DesiredState:
    return get_backend("vxlan").plan(ctx, [OWN], [peer], OWN_MAC)


def path_to_peer(state: DesiredState) -> str:
    (route,) = [r for r in state.routes if r.dst == PEER_SUBNET]
    return "direct" if route.ifname == "eth0" else "vxlan"


@pytest.mark.parametrize(
    ("cluster_dr", "own_dr", "expected"),
    [
        # flanneld follows the config's own DirectRouting, whatever this node runs.
        (True, None, "direct"),
        (False, None, "vxlan"),
        (True, False, "direct"),  # flanneld routes to us directly: so do we
        (False, True, "vxlan"),  # flanneld encapsulates to us: so do we
    ],
)
def test_a_flanneld_peer_gets_the_path_flanneld_takes_back(
    cluster_dr: bool, own_dr: bool | None, expected: str
) -> None:
    assert path_to_peer(plan(ctx_for(cluster_dr, own_dr), flanneld_peer())) == expected


@pytest.mark.parametrize(
    ("own_dr", "peer_dr", "expected"),
    [
        (False, False, "vxlan"),
        (True, False, "direct"),
        (False, True, "direct"),
        (True, True, "direct"),
    ],
)
def test_between_our_nodes_either_end_asking_for_direct_is_enough(
    own_dr: bool, peer_dr: bool, expected: str
) -> None:
    """Our leases carry DirectRouting, so both ends know both wishes."""
    assert path_to_peer(plan(ctx_for(False, own_dr), our_peer(peer_dr))) == expected


def test_an_override_keeps_the_config_s_own_backend_for_flanneld_peers() -> None:
    config = ctx_for(True, False).config
    assert config.backend.direct_routing is False
    assert config.flanneld_backend.direct_routing is True
    assert wanted_config(config_doc(True), None).flanneld_backend.direct_routing is True


@pytest.mark.parametrize("backend", ["ipsec", "udp", "extension"])
@pytest.mark.parametrize("ip", [ON_LINK, "192.168.2.20"])
def test_a_peer_of_a_backend_we_do_not_speak_is_reported_not_routed(backend: str, ip: str) -> None:
    state = plan(ctx_for(True, None), flanneld_peer(ip, backend))
    assert not state.routes and not state.fdb and not state.neighbours
    (unreachable,) = state.unreachable
    assert unreachable.subnet == PEER_SUBNET
    assert f"it runs the {backend} backend, which flannelpy does not speak" in unreachable.reason


def test_a_host_gw_node_does_not_route_a_wireguard_peer_either() -> None:
    ctx = ctx_for(False, None)
    hostgw = NodeContext(
        config=wanted_config(config_doc(False), NodeOverride({"Type": "host-gw"}, 1)),
        underlay=ctx.underlay,
        public_ip=ctx.public_ip,
        node_name=ctx.node_name,
    )
    state = get_backend("host-gw").plan(hostgw, [OWN], [flanneld_peer(backend="wireguard")], None)
    assert Route(PEER_SUBNET, IPv4Address(ON_LINK), "eth0") not in state.routes
    assert len(state.unreachable) == 1
