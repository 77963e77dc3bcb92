from dataclasses import replace
from ipaddress import IPv4Address, IPv4Interface, IPv4Network

import pytest

from flannelpy.backend.base import NodeContext
from flannelpy.backend.registry import get_backend
from flannelpy.dataplane.state import Address, DesiredState, FdbEntry, Neighbour, Route
from flannelpy.errors import ConfigError
from flannelpy.subnet.lease import Lease, LeaseAttrs
from tests.support.fakes import context, lease, underlay

OWN = lease("10.244.1.0/24", "192.168.1.10", mac="02:00:00:00:00:01")
PEER_SAME_SEGMENT = lease("10.244.2.0/24", "192.168.1.11", mac="02:00:00:00:00:02")
PEER_OTHER_SEGMENT = lease("10.244.3.0/24", "192.168.2.12", mac="02:00:00:00:00:03")
PEER_HOSTGW = lease("10.244.4.0/24", "192.168.1.13", backend="host-gw")


def test_vxlan_programs_flannels_recipe_per_peer() -> None:
    ctx = context("vxlan")
    state = get_backend("vxlan").plan(ctx, [OWN], [PEER_SAME_SEGMENT], "02:00:00:00:00:01")
    (link,) = state.links
    assert (link.name, link.vni, link.port, link.mtu, link.learning) == (
        "flannel.1",
        1,
        8472,
        1450,
        False,
    )
    assert link.local_ip == IPv4Address("192.168.1.10") and link.underlay == "eth0"
    assert state.addresses == {Address("flannel.1", IPv4Interface("10.244.1.0/32"))}
    assert state.neighbours == {
        Neighbour("flannel.1", IPv4Address("10.244.2.0"), "02:00:00:00:00:02")
    }
    assert state.fdb == {FdbEntry("flannel.1", "02:00:00:00:00:02", IPv4Address("192.168.1.11"))}
    assert state.routes == {
        Route(IPv4Network("10.244.2.0/24"), IPv4Address("10.244.2.0"), "flannel.1", onlink=True)
    }
    assert state.owned_devices == {"flannel.1"}


def test_vxlan_mtu_follows_the_configured_underlay_mtu() -> None:
    backend = get_backend("vxlan")
    assert backend.mtu(context("vxlan", mtu=9000)) == 8950


def test_direct_routing_routes_same_segment_peers_directly_and_encapsulates_the_rest() -> None:
    ctx = context("vxlan", direct_routing=True)
    state = get_backend("vxlan").plan(
        ctx, [OWN], [PEER_SAME_SEGMENT, PEER_OTHER_SEGMENT], "02:00:00:00:00:01"
    )
    assert Route(IPv4Network("10.244.2.0/24"), IPv4Address("192.168.1.11"), "eth0") in state.routes
    assert (
        Route(IPv4Network("10.244.3.0/24"), IPv4Address("10.244.3.0"), "flannel.1", onlink=True)
        in state.routes
    )
    assert {n.ip for n in state.neighbours} == {IPv4Address("10.244.3.0")}
    assert not state.unreachable


def test_host_gw_routes_via_peer_and_reports_peers_off_segment() -> None:
    ctx = context("host-gw")
    backend = get_backend("HOST-GW")
    state = backend.plan(ctx, [OWN], [PEER_SAME_SEGMENT, PEER_OTHER_SEGMENT], None)
    assert state.routes == {
        Route(IPv4Network("10.244.2.0/24"), IPv4Address("192.168.1.11"), "eth0")
    }
    (unreachable,) = state.unreachable
    assert unreachable.subnet == IPv4Network("10.244.3.0/24")
    assert "192.168.2.12" in unreachable.reason and "vxlan" in unreachable.reason
    assert not state.links and backend.mtu(ctx) == 1500


def test_vxlan_reaches_host_gw_peer_directly_when_on_segment() -> None:
    state = get_backend("vxlan").plan(context("vxlan"), [OWN], [PEER_HOSTGW], "02:00:00:00:00:01")
    assert Route(IPv4Network("10.244.4.0/24"), IPv4Address("192.168.1.13"), "eth0") in state.routes
    assert not state.neighbours


def test_stale_lease_with_our_own_address_is_never_routed() -> None:
    stale_self = lease("10.244.9.0/24", "192.168.1.10", mac="02:00:00:00:00:09")
    state = get_backend("vxlan").plan(context(), [OWN], [stale_self], "02:00:00:00:00:01")
    assert not state.routes and not state.fdb


def test_lease_attrs_are_flannels_plus_extensions() -> None:
    attrs = get_backend("vxlan").lease_attrs(context(), "02:00:00:00:00:01")
    assert attrs.backend_data == {"VNI": 1, "VtepMAC": "02:00:00:00:00:01"}
    assert attrs.node_name == "node-a" and attrs.mtu == 1450
    assert get_backend("host-gw").lease_attrs(context("host-gw"), None).backend_data is None


def test_unknown_backend_is_a_config_error_naming_the_choices() -> None:
    with pytest.raises(ConfigError, match="vxlan, host-gw"):
        get_backend("udp")


# --- mixed backends: one planner, a path per peer chosen from both ends ---------------------

OWN_MAC = "02:00:00:00:00:01"
PEER_MAC = "02:00:00:00:00:0a"
PEER_SUBNET = IPv4Network("10.244.5.0/24")
PEER_VTEP_IP = IPv4Address("10.244.5.0")
ON_LINK, OFF_LINK = "192.168.1.20", "192.168.2.20"

# own node kind -> (backend, DirectRouting, vtep_mac the agent passes)
OWN_KINDS: dict[str, tuple[str, bool, str | None]] = {
    "vxlan": ("vxlan", False, OWN_MAC),
    "vxlan+dr": ("vxlan", True, OWN_MAC),
    "host-gw": ("host-gw", False, None),
    "host-gw+vtep": ("host-gw", False, OWN_MAC),
}


def peer_lease(kind: str, ip: str) -> Lease:
    vtep = {"VNI": 1, "VtepMAC": PEER_MAC}
    attrs = {
        "vxlan": LeaseAttrs(IPv4Address(ip), "vxlan", vtep),
        "vxlan+dr": LeaseAttrs(IPv4Address(ip), "vxlan", vtep, direct_routing=True),
        "vxlan-vni2": LeaseAttrs(IPv4Address(ip), "vxlan", {"VNI": 2, "VtepMAC": PEER_MAC}),
        "host-gw": LeaseAttrs(IPv4Address(ip), "host-gw"),
        "host-gw+vtep": LeaseAttrs(IPv4Address(ip), "host-gw", vtep),
    }[kind]
    return Lease(PEER_SUBNET, replace(attrs, mtu=1450))  # a node of ours: it has our extension


D, V, U = "direct", "vxlan", "unreachable"
MIXED_TABLE = [
    # own,           peer,           on-link, off-link
    ("vxlan",        "vxlan",        V, V),
    ("vxlan",        "vxlan+dr",     D, V),
    ("vxlan",        "host-gw",      D, U),
    ("vxlan",        "host-gw+vtep", D, V),
    ("vxlan",        "vxlan-vni2",   U, U),
    ("vxlan+dr",     "vxlan",        D, V),
    ("vxlan+dr",     "host-gw",      D, U),
    ("vxlan+dr",     "host-gw+vtep", D, V),
    ("vxlan+dr",     "vxlan-vni2",   D, U),
    ("host-gw",      "vxlan",        D, U),
    ("host-gw",      "host-gw",      D, U),
    ("host-gw",      "host-gw+vtep", D, U),
    ("host-gw+vtep", "vxlan",        D, V),
    ("host-gw+vtep", "vxlan+dr",     D, V),
    ("host-gw+vtep", "host-gw",      D, U),
    ("host-gw+vtep", "host-gw+vtep", D, V),
    ("host-gw+vtep", "vxlan-vni2",   D, U),
]  # fmt: skip


@pytest.mark.parametrize(
    ("own_kind", "peer_kind", "peer_ip", "expected"),
    [(own, peer, ON_LINK, on) for own, peer, on, _ in MIXED_TABLE]
    + [(own, peer, OFF_LINK, off) for own, peer, _, off in MIXED_TABLE],
)
def test_each_peer_gets_the_path_both_ends_can_use(
    own_kind: str, peer_kind: str, peer_ip: str, expected: str
) -> None:
    backend_type, direct_routing, vtep_mac = OWN_KINDS[own_kind]
    ctx = context(backend_type, direct_routing=direct_routing)
    state = get_backend(backend_type).plan(ctx, [OWN], [peer_lease(peer_kind, peer_ip)], vtep_mac)
    gateway = IPv4Address(peer_ip)
    if expected == D:
        assert state.routes == {Route(PEER_SUBNET, gateway, "eth0")}
    if expected == V:
        assert state.routes == {Route(PEER_SUBNET, PEER_VTEP_IP, "flannel.1", onlink=True)}
        assert state.neighbours == {Neighbour("flannel.1", PEER_VTEP_IP, PEER_MAC)}
        assert state.fdb == {FdbEntry("flannel.1", PEER_MAC, gateway)}
    else:
        assert not state.neighbours and not state.fdb
    if expected == U:
        assert not state.routes
        (unreachable,) = state.unreachable
        assert (unreachable.subnet, unreachable.public_ip) == (PEER_SUBNET, gateway)
        assert unreachable.reason.startswith(f"no path to peer {peer_ip}, which is ")
    else:
        assert not state.unreachable
    # The device exists exactly when this node has a VTEP.
    assert {link.name for link in state.links} == ({"flannel.1"} if vtep_mac else set())


@pytest.mark.parametrize("own_kind", list(OWN_KINDS))
@pytest.mark.parametrize("peer_kind", list(OWN_KINDS))
@pytest.mark.parametrize("peer_ip", [ON_LINK, OFF_LINK])
def test_both_nodes_of_a_pair_plan_the_same_kind_of_path(
    own_kind: str, peer_kind: str, peer_ip: str
) -> None:
    """Each node plans from the other's advertised lease; the two plans must agree."""

    def node(kind: str, ip: str, subnet: str) -> tuple[NodeContext, Lease, str | None]:
        backend_type, direct_routing, mac = OWN_KINDS[kind]
        ctx = context(backend_type, ip=ip, direct_routing=direct_routing)
        attrs = get_backend(backend_type).lease_attrs(ctx, mac)
        return ctx, Lease(IPv4Network(subnet), attrs), mac

    def kind_of(state: DesiredState) -> str:
        if state.unreachable:
            return U
        return V if state.neighbours else D

    a_ctx, a_lease, a_mac = node(own_kind, "192.168.1.10", "10.244.1.0/24")
    b_ctx, b_lease, b_mac = node(peer_kind, peer_ip, "10.244.2.0/24")
    # The peer's underlay is its own segment: 192.168.1.0/24 or 192.168.2.0/24.
    b_segment = str(IPv4Network(f"{peer_ip}/24", strict=False))
    b_ctx = replace(b_ctx, underlay=underlay(peer_ip, (b_segment,)))
    a_plan = get_backend(a_ctx.config.backend.type).plan(a_ctx, [a_lease], [b_lease], a_mac)
    b_plan = get_backend(b_ctx.config.backend.type).plan(b_ctx, [b_lease], [a_lease], b_mac)
    assert kind_of(a_plan) == kind_of(b_plan)


def test_vxlan_node_reaches_a_host_gw_peer_without_vtep_on_link_only() -> None:
    ctx = context("vxlan")
    on = get_backend("vxlan").plan(ctx, [OWN], [peer_lease("host-gw", ON_LINK)], OWN_MAC)
    assert on.routes == {Route(PEER_SUBNET, IPv4Address(ON_LINK), "eth0")}
    off = get_backend("vxlan").plan(ctx, [OWN], [peer_lease("host-gw", OFF_LINK)], OWN_MAC)
    (unreachable,) = off.unreachable
    assert unreachable.reason == (
        "no path to peer 192.168.2.20, which is not on a subnet of eth0 (192.168.1.0/24): "
        "the nodes are on different L2 segments and only one of them has a VTEP; host-gw needs "
        "every node on one L2 segment: use vxlan, or vxlan with DirectRouting"
    )


def test_host_gw_node_with_vtep_routes_on_link_peers_directly_and_encapsulates_the_rest() -> None:
    ctx = context("host-gw")
    backend = get_backend("host-gw")
    peers = [PEER_SAME_SEGMENT, PEER_OTHER_SEGMENT]
    state = backend.plan(ctx, [OWN], peers, OWN_MAC)
    (link,) = state.links
    assert (link.name, link.vni, link.mtu, link.mac, link.local_ip) == (
        "flannel.1",
        1,
        1450,
        OWN_MAC,
        IPv4Address("192.168.1.10"),
    )
    assert state.addresses == {Address("flannel.1", IPv4Interface("10.244.1.0/32"))}
    assert state.owned_devices == {"flannel.1"}
    assert state.routes == {
        Route(IPv4Network("10.244.2.0/24"), IPv4Address("192.168.1.11"), "eth0"),
        Route(IPv4Network("10.244.3.0/24"), IPv4Address("10.244.3.0"), "flannel.1", onlink=True),
    }
    assert state.fdb == {FdbEntry("flannel.1", "02:00:00:00:00:03", IPv4Address("192.168.2.12"))}
    # Pods and subnet.env keep the underlay MTU: host-gw traffic is not encapsulated.
    assert backend.mtu(ctx) == 1500


def test_host_gw_without_vtep_mac_has_no_device_but_owns_its_name() -> None:
    ctx = context("host-gw", vni=4)
    backend = get_backend("host-gw")
    state = backend.plan(ctx, [OWN], [PEER_SAME_SEGMENT], None)
    assert not state.links and not state.addresses and not state.owned_devices
    assert backend.device_names(ctx) == ("flannel.4", "flannel-v6.4")


def test_host_gw_advertises_its_vtep_only_while_it_has_one() -> None:
    backend = get_backend("host-gw")
    ctx = context("host-gw")
    assert backend.lease_attrs(ctx, OWN_MAC).backend_data == {"VNI": 1, "VtepMAC": OWN_MAC}
    assert backend.lease_attrs(ctx, None).backend_data is None
    assert backend.lease_attrs(ctx, OWN_MAC).direct_routing is None


def test_vxlan_advertises_direct_routing_when_configured() -> None:
    backend = get_backend("vxlan")
    assert backend.lease_attrs(context("vxlan", direct_routing=True), OWN_MAC).direct_routing
    assert backend.lease_attrs(context("vxlan"), OWN_MAC).direct_routing is None


@pytest.mark.parametrize(
    ("backend", "peers", "expected"),
    [
        ("vxlan", [], True),
        ("host-gw", [PEER_HOSTGW], False),
        ("host-gw", [PEER_HOSTGW, PEER_OTHER_SEGMENT], True),
        # a vxlan lease with our own address is a stale one of ours, not a peer
        ("host-gw", [lease("10.244.9.0/24", "192.168.1.10", mac="02:00:00:00:00:09")], False),
    ],
)
def test_needs_vtep_while_a_peer_is_vxlan(backend: str, peers: list[Lease], expected: bool) -> None:
    assert get_backend(backend).needs_vtep(context(backend), peers) is expected


def test_vni_mismatch_off_link_is_unreachable() -> None:
    state = get_backend("vxlan").plan(
        context("vxlan"), [OWN], [peer_lease("vxlan-vni2", OFF_LINK)], OWN_MAC
    )
    (unreachable,) = state.unreachable
    assert "different VNIs (1 and 2)" in unreachable.reason
    assert not state.routes and not state.fdb


@pytest.mark.parametrize("backend", ["vxlan", "host-gw"])
def test_ip_blackhole_route_plans_a_blackhole_for_the_own_subnet_only(backend: str) -> None:
    ctx = replace(context(backend), blackhole_own_subnets=True)
    state = get_backend(backend).plan(ctx, [OWN], [PEER_SAME_SEGMENT], "02:00:00:00:00:01")
    blackholes = {r for r in state.routes if r.blackhole}
    assert blackholes == {Route(IPv4Network("10.244.1.0/24"), IPv4Address(0), "", blackhole=True)}
    # The peer keeps its ordinary route; without the flag there is no blackhole at all.
    assert any(r.dst == PEER_SAME_SEGMENT.subnet and not r.blackhole for r in state.routes)
    plain = get_backend(backend).plan(
        context(backend), [OWN], [PEER_SAME_SEGMENT], "02:00:00:00:00:01"
    )
    assert plain.routes == state.routes - blackholes
