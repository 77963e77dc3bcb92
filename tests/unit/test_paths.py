"""The path rule between two nodes of a mixed cluster, and cluster feasibility."""

from __future__ import annotations

from ipaddress import IPv4Address, IPv4Network

import pytest
from hypothesis import given
from hypothesis import strategies as st

from flannelpy.backend.paths import (
    Capabilities,
    NodeView,
    NoPath,
    choose_path,
    needs_vtep,
    own_capabilities,
    pairs_without_path,
    peer_capabilities,
)
from flannelpy.config.netconf import BackendConfig
from flannelpy.subnet.lease import Lease, LeaseAttrs

MAC = "02:00:00:00:00:02"
PUB = "HIgo9xNzJMWLKASShiTqIybxZ0U3wGLiUeJ1PKf8ykw="  # a WireGuard public key

VXLAN = Capabilities(prefers_direct=False, vni=1, vtep_mac=MAC)
VXLAN_DR = Capabilities(prefers_direct=True, vni=1, vtep_mac=MAC)
HOSTGW = Capabilities(prefers_direct=True, vni=None, vtep_mac=None)
HOSTGW_VTEP = Capabilities(prefers_direct=True, vni=1, vtep_mac=MAC)
VXLAN_VNI2 = Capabilities(prefers_direct=False, vni=2, vtep_mac=MAC)
WIREGUARD = Capabilities(
    prefers_direct=False, vni=None, vtep_mac=None, encrypts=True, wireguard_key=True
)
KEPT_WG = Capabilities(prefers_direct=False, vni=1, vtep_mac=MAC, wireguard_key=True)
KEPT_WG_DR = Capabilities(prefers_direct=True, vni=1, vtep_mac=MAC, wireguard_key=True)

capabilities = st.builds(
    Capabilities,
    prefers_direct=st.booleans(),
    vni=st.none() | st.integers(1, 3),
    vtep_mac=st.none() | st.just(MAC),
    follows_peer=st.booleans(),  # False: a flanneld end
    foreign_backend=st.none() | st.just("ipsec"),
    encrypts=st.booleans(),  # a wireguard end
    wireguard_key=st.booleans(),
)


@given(capabilities, capabilities, st.booleans())
def test_both_ends_of_a_pair_choose_the_same_path(
    a: Capabilities, b: Capabilities, on_link: bool
) -> None:
    assert choose_path(a, b, on_link) == choose_path(b, a, on_link)


@given(capabilities, capabilities, st.booleans())
def test_a_chosen_path_is_one_both_ends_can_use(
    a: Capabilities, b: Capabilities, on_link: bool
) -> None:
    path = choose_path(a, b, on_link)
    if path == "direct":
        assert on_link
        assert not a.encrypts and not b.encrypts  # never plain to a node that asked for encryption
    elif path == "wireguard":
        # one end asked for encryption; the other runs wireguard or keeps its device
        assert (a.encrypts or b.encrypts) and a.wireguard_key and b.wireguard_key
    elif path == "vxlan":
        assert a.has_vtep and b.has_vtep and a.vni == b.vni


@pytest.mark.parametrize(
    ("own", "peer", "on_link", "expected"),
    [
        (VXLAN, VXLAN, True, "vxlan"),  # plain vxlan encapsulates even on one segment
        (VXLAN, VXLAN, False, "vxlan"),
        (VXLAN, VXLAN_DR, True, "direct"),  # one end prefers direct: both route directly
        (VXLAN, VXLAN_DR, False, "vxlan"),
        (VXLAN, HOSTGW, True, "direct"),
        (VXLAN, HOSTGW, False, "neither"),
        (VXLAN, HOSTGW_VTEP, True, "direct"),
        (VXLAN, HOSTGW_VTEP, False, "vxlan"),
        (HOSTGW, HOSTGW, True, "direct"),
        (HOSTGW, HOSTGW, False, "neither"),
        (HOSTGW_VTEP, HOSTGW_VTEP, False, "vxlan"),
        (VXLAN, VXLAN_VNI2, False, "neither"),
        (VXLAN, VXLAN_VNI2, True, "neither"),  # both encapsulate, different VNIs
        (VXLAN_DR, VXLAN_VNI2, True, "direct"),
        # switching back from wireguard: a node that kept its key stays encrypted with a
        # wireguard peer (which may have no VTEP any more), and talks plain to one like it
        (KEPT_WG, WIREGUARD, False, "wireguard"),
        (KEPT_WG, WIREGUARD, True, "wireguard"),
        (KEPT_WG, KEPT_WG, False, "vxlan"),
        (KEPT_WG, KEPT_WG_DR, True, "direct"),
        (VXLAN, WIREGUARD, False, "neither"),  # no key kept, no VTEP on the peer
    ],
)
def test_choose_path_table(
    own: Capabilities, peer: Capabilities, on_link: bool, expected: str
) -> None:
    path = choose_path(own, peer, on_link)
    if expected == "neither":
        assert isinstance(path, NoPath)
    else:
        assert path == expected


@pytest.mark.parametrize(
    ("own", "peer", "on_link", "words"),
    [
        (HOSTGW, HOSTGW, False, ("different L2 segments", "neither has a VTEP", "use vxlan")),
        (VXLAN, HOSTGW, False, ("only one of them has a VTEP", "vxlan with DirectRouting")),
        (VXLAN, VXLAN_VNI2, False, ("different VNIs (1 and 2)", "set one VNI")),
        (VXLAN_VNI2, VXLAN, True, ("different VNIs (1 and 2)", "DirectRouting on one of them")),
    ],
)
def test_no_path_says_why_and_what_to_change(
    own: Capabilities, peer: Capabilities, on_link: bool, words: tuple[str, ...]
) -> None:
    path = choose_path(own, peer, on_link)
    assert isinstance(path, NoPath)
    for word in words:
        assert word in path.reason


@pytest.mark.parametrize(
    ("backend", "vtep_mac", "expected"),
    [
        (BackendConfig("vxlan"), MAC, Capabilities(False, 1, MAC)),
        (BackendConfig("vxlan", vni=7), None, Capabilities(False, 7, None)),  # device anyway
        (BackendConfig("vxlan", direct_routing=True), MAC, Capabilities(True, 1, MAC)),
        (BackendConfig("host-gw"), None, Capabilities(True, None, None)),
        (BackendConfig("host-gw", vni=4), MAC, Capabilities(True, 4, MAC)),
    ],
)
def test_own_capabilities(
    backend: BackendConfig, vtep_mac: str | None, expected: Capabilities
) -> None:
    assert own_capabilities(backend, vtep_mac) == expected


def lease(
    backend: str,
    data: dict[str, object] | None = None,
    direct_routing: bool | None = None,
    ip: str = "192.168.1.11",
    mtu: int | None = 1450,
) -> Lease:
    """A peer's lease: one of ours (with our extension) unless ``mtu`` is None."""
    return Lease(
        IPv4Network("10.244.2.0/24"),
        LeaseAttrs(
            IPv4Address(ip), backend, backend_data=data, direct_routing=direct_routing, mtu=mtu
        ),
    )


@pytest.mark.parametrize(
    ("peer", "expected"),
    [
        (lease("vxlan", {"VNI": 1, "VtepMAC": MAC}), Capabilities(False, 1, MAC)),
        (
            lease("vxlan", {"VNI": 3, "VtepMAC": MAC.upper()}, direct_routing=True),
            Capabilities(True, 3, MAC),
        ),
        (lease("host-gw"), Capabilities(True, None, None)),
        (lease("host-gw", {"VNI": 1, "VtepMAC": MAC}), Capabilities(True, 1, MAC)),
        # a VTEP is usable only with both its VNI and its MAC
        (lease("vxlan", {"VNI": 1, "VtepMAC": None}), Capabilities(False, None, None)),
        (lease("vxlan", {"VtepMAC": MAC}), Capabilities(False, None, None)),
        (lease("vxlan", {"VNI": True, "VtepMAC": MAC}), Capabilities(False, None, None)),
        # another backend's data is no VTEP, whatever it holds
        (
            lease("ipsec", {"VNI": 1, "VtepMAC": MAC}),
            Capabilities(False, None, None, foreign_backend="ipsec"),
        ),
        # a wireguard node keeps a VTEP while a peer is vxlan; without a key, no tunnel
        (
            lease("wireguard", {"VNI": 1, "VtepMAC": MAC}),
            Capabilities(False, 1, MAC, encrypts=True, wireguard_key=False),
        ),
        # a node of ours that switched away from wireguard keeps its key while a peer runs it
        (
            lease("vxlan", {"VNI": 1, "VtepMAC": MAC, "PublicKey": PUB}),
            Capabilities(False, 1, MAC, wireguard_key=True),
        ),
        (lease("host-gw", {"PublicKey": PUB}), Capabilities(True, None, None, wireguard_key=True)),
        # flanneld has no such transition: a key in its vxlan lease means nothing
        (
            lease("vxlan", {"VNI": 1, "VtepMAC": MAC, "PublicKey": PUB}, mtu=None),
            Capabilities(False, 1, MAC, follows_peer=False),
        ),
    ],
)
def test_peer_capabilities_come_from_the_lease(peer: Lease, expected: Capabilities) -> None:
    assert peer_capabilities(peer) == expected


@pytest.mark.parametrize(
    ("backend", "peers", "expected"),
    [
        ("vxlan", [], True),
        ("vxlan", [lease("host-gw")], True),
        ("host-gw", [], False),
        ("host-gw", [lease("host-gw"), lease("host-gw", {"VNI": 1, "VtepMAC": MAC})], False),
        ("host-gw", [lease("host-gw"), lease("VXLAN", {"VNI": 1, "VtepMAC": MAC})], True),
    ],
)
def test_needs_vtep(backend: str, peers: list[Lease], expected: bool) -> None:
    assert needs_vtep(BackendConfig(backend), peers) is expected


# --- cluster feasibility --------------------------------------------------------------------

SEG_A = (IPv4Network("100.64.0.0/24"),)
SEG_B = (IPv4Network("100.64.1.0/24"),)
ONE_SEGMENT = (
    ("n1", "100.64.0.1", SEG_A),
    ("n2", "100.64.0.2", SEG_A),
    ("n3", "100.64.0.3", SEG_A),
)
TWO_SEGMENTS = (
    ("n1", "100.64.0.1", SEG_A),
    ("n2", "100.64.0.2", SEG_A),
    ("n3", "100.64.1.3", SEG_B),
)
HOST_GW = BackendConfig("host-gw")
VX = BackendConfig("vxlan")
VX_DR = BackendConfig("vxlan", direct_routing=True)


def cluster(
    layout: tuple[tuple[str, str, tuple[IPv4Network, ...]], ...],
    *backends: BackendConfig,
    has_vtep: tuple[bool | None, ...] = (None, None, None),
) -> list[NodeView]:
    return [
        NodeView(name, IPv4Address(ip), nets, backend, vtep)
        for (name, ip, nets), backend, vtep in zip(layout, backends, has_vtep, strict=True)
    ]


@pytest.mark.parametrize(
    "backends",
    [
        (HOST_GW, HOST_GW, HOST_GW),
        (VX, VX, VX),
        (VX_DR, VX_DR, VX_DR),
        (HOST_GW, VX, VX_DR),
        (HOST_GW, HOST_GW, VX),
    ],
)
def test_every_backend_mix_works_on_one_segment(backends: tuple[BackendConfig, ...]) -> None:
    assert pairs_without_path(cluster(ONE_SEGMENT, *backends)) == []


@pytest.mark.parametrize(
    "backends",
    [
        (VX, VX, VX),
        (VX_DR, VX_DR, VX_DR),
        (VX, VX_DR, VX),
        # host-gw nodes keep a VTEP while some node is vxlan, so mid-rollout states work
        (HOST_GW, VX, VX),
        (HOST_GW, HOST_GW, VX),
        (VX, VX, HOST_GW),
        (HOST_GW, VX_DR, HOST_GW),
    ],
)
def test_two_segments_work_while_some_node_is_vxlan(backends: tuple[BackendConfig, ...]) -> None:
    assert pairs_without_path(cluster(TWO_SEGMENTS, *backends)) == []


def test_host_gw_across_two_segments_names_every_broken_pair() -> None:
    found = pairs_without_path(cluster(TWO_SEGMENTS, HOST_GW, HOST_GW, HOST_GW))
    assert [(a, b) for a, b, _ in found] == [("n1", "n3"), ("n2", "n3")]
    assert all("neither has a VTEP" in reason for _, _, reason in found)


def test_an_observed_missing_vtep_breaks_the_pairs_across_segments() -> None:
    found = pairs_without_path(cluster(TWO_SEGMENTS, VX, VX, HOST_GW, has_vtep=(None, None, False)))
    assert [(a, b) for a, b, _ in found] == [("n1", "n3"), ("n2", "n3")]
    assert all("only one of them has a VTEP" in reason for _, _, reason in found)


def test_a_vni_mismatch_across_segments_is_found() -> None:
    found = pairs_without_path(cluster(TWO_SEGMENTS, VX, VX, BackendConfig("vxlan", vni=2)))
    assert [(a, b) for a, b, _ in found] == [("n1", "n3"), ("n2", "n3")]
    assert "different VNIs (1 and 2)" in found[0][2]


def test_ends_that_disagree_about_sharing_a_segment_are_found() -> None:
    # n1's /16 covers n3, n3's /24 does not cover n1: n1 would route directly, n3 encapsulate.
    wide = (IPv4Network("100.64.0.0/16"),)
    layout = (("n1", "100.64.0.1", wide), ("n2", "100.64.0.2", SEG_A), ("n3", "100.64.1.3", SEG_B))
    found = pairs_without_path(cluster(layout, VX_DR, VX_DR, VX_DR))
    assert [(a, b) for a, b, _ in found] == [("n1", "n3")]
    assert "n1 takes a direct path and n3 a vxlan one" in found[0][2]
