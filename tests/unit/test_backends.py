from ipaddress import IPv4Address, IPv4Interface, IPv4Network

import pytest

from flannelpy.backend.registry import get_backend
from flannelpy.dataplane.state import Address, FdbEntry, Neighbour, Route
from flannelpy.errors import ConfigError
from tests.unit.fakes import context, lease

OWN = lease("10.244.1.0/24", "192.168.1.10", mac="02:00:00:00:00:01")
PEER_SAME_SEGMENT = lease("10.244.2.0/24", "192.168.1.11", mac="02:00:00:00:00:02")
PEER_OTHER_SEGMENT = lease("10.244.3.0/24", "192.168.2.12", mac="02:00:00:00:00:03")
PEER_HOSTGW = lease("10.244.4.0/24", "192.168.1.13", backend="host-gw")


def test_vxlan_programs_flannels_recipe_per_peer() -> None:
    ctx = context("vxlan")
    state = get_backend("vxlan").plan(ctx, [OWN], [PEER_SAME_SEGMENT], "02:00:00:00:00:01")
    (link,) = state.links
    assert (link.name, link.vni, link.port, link.mtu, link.learning) == (
        "flannel.1", 1, 8472, 1450, False)
    assert link.local_ip == IPv4Address("192.168.1.10") and link.underlay == "eth0"
    assert state.addresses == {Address("flannel.1", IPv4Interface("10.244.1.0/32"))}
    assert state.neighbours == {
        Neighbour("flannel.1", IPv4Address("10.244.2.0"), "02:00:00:00:00:02")}
    assert state.fdb == {FdbEntry("flannel.1", "02:00:00:00:00:02", IPv4Address("192.168.1.11"))}
    assert state.routes == {
        Route(IPv4Network("10.244.2.0/24"), IPv4Address("10.244.2.0"), "flannel.1", onlink=True)}
    assert state.owned_devices == {"flannel.1"}


def test_vxlan_mtu_follows_the_configured_underlay_mtu() -> None:
    backend = get_backend("vxlan")
    assert backend.mtu(context("vxlan", mtu=9000)) == 8950


def test_direct_routing_routes_same_segment_peers_directly_and_encapsulates_the_rest() -> None:
    ctx = context("vxlan", direct_routing=True)
    state = get_backend("vxlan").plan(
        ctx, [OWN], [PEER_SAME_SEGMENT, PEER_OTHER_SEGMENT], "02:00:00:00:00:01")
    assert Route(IPv4Network("10.244.2.0/24"), IPv4Address("192.168.1.11"), "eth0") in state.routes
    assert Route(IPv4Network("10.244.3.0/24"), IPv4Address("10.244.3.0"), "flannel.1",
                 onlink=True) in state.routes
    assert {n.ip for n in state.neighbours} == {IPv4Address("10.244.3.0")}
    assert not state.unreachable


def test_host_gw_routes_via_peer_and_reports_peers_off_segment() -> None:
    ctx = context("host-gw")
    backend = get_backend("HOST-GW")
    state = backend.plan(ctx, [OWN], [PEER_SAME_SEGMENT, PEER_OTHER_SEGMENT], None)
    assert state.routes == {
        Route(IPv4Network("10.244.2.0/24"), IPv4Address("192.168.1.11"), "eth0")}
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
