"""A dual-stack rollout to and from wireguard is made before broken in IPv6 too: each
family keeps its VTEP (flannel.1, flannel-v6.1) and its WireGuard device (flannel-wg,
flannel-wg-v6) while a pair still needs it, and a pair's IPv6 half waits for
flannel-wg-v6's own handshake."""

from __future__ import annotations

from dataclasses import replace
from ipaddress import IPv4Address, IPv4Network, IPv6Address, IPv6Network
from typing import Any

from flannelpy.backend.base import NodeContext, node_needs_vtep
from flannelpy.backend.vxlan import VxlanBackend
from flannelpy.backend.wireguard import (
    WireguardBackend,
    keeping_context,
    kept_devices_mtu,
    plan_kept,
    unencrypted_peers,
    with_kept_key,
)
from flannelpy.backend.wireguard_config import WireguardConfig, WireguardIdentity
from flannelpy.dataplane.state import DesiredState, Route
from flannelpy.dataplane.wgkeys import generate_private_key, public_key
from flannelpy.subnet.lease import Lease, LeaseAttrs
from tests.unit.test_dual_stack_node import ctx as dual_ctx

OWN_MAC, OWN_MAC6 = "02:00:00:00:00:01", "06:00:00:00:00:01"
KEY = public_key(generate_private_key())  # ours
PEER_KEY = public_key(generate_private_key())
IDENTITY = WireguardIdentity(KEY, WireguardConfig())
NET6 = IPv6Network("fc00::/48")


def subnet6(n: int) -> IPv6Network:
    return IPv6Network(f"fc00:0:0:{n:x}::/64")


def node(backend: str, **changes: Any) -> NodeContext:
    """Our dual-stack node (192.168.1.10, fd00:64::10) with its WireGuard key loaded."""
    return replace(dual_ctx(backend), wireguard_identity=IDENTITY, **changes)


def peer_node(n: int, backend: str, key: str | None = None) -> NodeContext:
    """The node of :func:`dual_peer` ``n``, planning for itself."""
    ctx = dual_ctx(backend)
    ip, ip6 = IPv4Address(f"192.168.1.{n}"), IPv6Address(f"fd00:64::{n:x}")
    identity = WireguardIdentity(key, WireguardConfig()) if key else None
    return replace(
        ctx,
        underlay=replace(ctx.underlay, ip=ip, ip6=ip6),
        public_ip=ip,
        public_ipv6=ip6,
        wireguard_identity=identity,
    )


def dual_peer(n: int, backend: str, key: str | None = None, vtep: bool = True) -> Lease:
    """A dual-stack peer lease as our agents write it: its VTEPs while it keeps them, its
    key and ports while it runs (or keeps) wireguard, in both BackendData and BackendV6Data."""
    data: dict[str, Any] = {"PublicKey": key, "Port": 51820} if key else {}
    data6: dict[str, Any] = {"PublicKey": key, "Port": 51821} if key else {}
    if vtep:
        data.update({"VNI": 1, "VtepMAC": f"02:00:00:00:00:{n:02x}"})
        data6.update({"VNI": 1, "VtepMAC": f"06:00:00:00:00:{n:02x}"})
    return Lease(
        subnet=IPv4Network(f"10.244.{n}.0/24"),
        ipv6_subnet=subnet6(n),
        attrs=LeaseAttrs(
            public_ip=IPv4Address(f"192.168.1.{n}"),
            backend_type=backend,
            backend_data=data or None,
            public_ipv6=IPv6Address(f"fd00:64::{n:x}"),
            backend_v6_data=data6 or None,
            mtu=1420 if backend == "wireguard" else 1430,
        ),
    )


OWN_WG = dual_peer(1, "wireguard", KEY)
OWN_VXLAN = dual_peer(1, "vxlan")


def v6_routes(desired: DesiredState) -> dict[IPv6Network, str]:
    return {r.dst: r.ifname for r in desired.routes if isinstance(r.dst, IPv6Network)}


def wg_device(desired: DesiredState, name: str) -> set[str]:
    """The public keys of the device ``name``'s peers (KeyError: no such device)."""
    (spec,) = [d for d in desired.wireguard if d.name == name]
    return {p.public_key for p in spec.peers}


# --- to wireguard ---------------------------------------------------------------------


def test_the_first_wireguard_node_keeps_flannel_v6_and_advertises_it_beside_its_key() -> None:
    ctx = node("wireguard", wireguard_confirmed=frozenset(), wireguard_confirmed_v6=frozenset())
    vxlan_peer = dual_peer(2, "vxlan")
    backend = WireguardBackend()
    assert node_needs_vtep(ctx, [vxlan_peer])
    attrs = backend.lease_attrs(ctx, OWN_MAC)
    assert attrs.backend_v6_data == {"PublicKey": KEY, "Port": 51821, "VNI": 1, "VtepMAC": OWN_MAC6}
    desired = backend.plan(ctx, [OWN_WG], [vxlan_peer], OWN_MAC)
    assert "flannel-v6.1" in {link.name for link in desired.links}
    assert v6_routes(desired) == {
        subnet6(2): "flannel-v6.1",
        NET6: "flannel-wg-v6",
    }
    assert not desired.unreachable
    # ...and the vxlan peer, seeing our lease, reaches our IPv6 subnet through its VTEP.
    as_peer = replace(OWN_WG, attrs=attrs)
    their_plan = VxlanBackend().plan(peer_node(2, "vxlan"), [vxlan_peer], [as_peer], OWN_MAC)
    assert v6_routes(their_plan)[subnet6(1)] == "flannel-v6.1"
    assert not their_plan.unreachable


def test_a_wireguard_pairs_ipv6_half_waits_for_flannel_wg_v6s_own_handshake() -> None:
    wg_peer = dual_peer(2, "wireguard", PEER_KEY)
    vxlan_peer = dual_peer(3, "vxlan")  # still on vxlan: every node keeps its VTEPs
    peers = [wg_peer, vxlan_peer]
    # flannel-wg has shaken hands with the peer, flannel-wg-v6 not yet.
    ctx = node(
        "wireguard",
        wireguard_confirmed=frozenset({PEER_KEY}),
        wireguard_confirmed_v6=frozenset(),
    )
    backend = WireguardBackend()
    desired = backend.plan(ctx, [OWN_WG], peers, OWN_MAC)
    ipv4 = {r.dst: r.ifname for r in desired.routes if isinstance(r.dst, IPv4Network)}
    assert IPv4Network("10.244.2.0/24") not in ipv4  # through flannel-wg, under the /16
    assert v6_routes(desired)[subnet6(2)] == "flannel-v6.1"  # held on vxlan
    assert PEER_KEY in wg_device(desired, "flannel-wg-v6")  # the device may shake hands
    assert unencrypted_peers(ctx, [OWN_WG], peers, has_vtep=True) == 2
    # Once flannel-wg-v6 has, the IPv6 half moves to the tunnel too.
    ctx = replace(ctx, wireguard_confirmed_v6=frozenset({PEER_KEY}))
    desired = backend.plan(ctx, [OWN_WG], peers, OWN_MAC)
    assert v6_routes(desired) == {
        subnet6(3): "flannel-v6.1",
        NET6: "flannel-wg-v6",
    }
    assert unencrypted_peers(ctx, [OWN_WG], peers, has_vtep=True) == 1
    # The last node to switch keeps its VTEPs while a pair's IPv6 half is held on them.
    held_v6 = replace(ctx, wireguard_confirmed_v6=frozenset())
    assert node_needs_vtep(held_v6, [wg_peer])
    assert not node_needs_vtep(ctx, [wg_peer])


# --- back to vxlan ----------------------------------------------------------------------


def test_a_node_back_on_vxlan_keeps_flannel_wg_v6_and_its_key_in_backend_v6_data() -> None:
    wg_peer = dual_peer(2, "wireguard", PEER_KEY, vtep=False)  # dropped its VTEPs
    vxlan_peer = dual_peer(3, "vxlan")
    peers = [wg_peer, vxlan_peer]
    ctx = keeping_context(node("vxlan"), "vxlan", peers, device_up=True)
    assert ctx.keeps_wireguard
    desired = plan_kept(
        ctx, [OWN_VXLAN], peers, VxlanBackend().plan(ctx, [OWN_VXLAN], peers, OWN_MAC)
    )
    # The wireguard peer's IPv6 subnet only through the kept flannel-wg-v6, under the /48.
    assert v6_routes(desired) == {
        subnet6(3): "flannel-v6.1",
        NET6: "flannel-wg-v6",
    }
    assert not desired.unreachable
    assert wg_device(desired, "flannel-wg-v6") == {PEER_KEY}
    (spec6,) = [d for d in desired.wireguard if d.name == "flannel-wg-v6"]
    (peer6,) = spec6.peers
    assert peer6.endpoint == (IPv6Address("fd00:64::2"), 51821)
    assert (spec6.listen_port, spec6.mtu) == (51821, 1420)
    attrs = with_kept_key(ctx, VxlanBackend().lease_attrs(ctx, OWN_MAC))
    assert attrs.backend_v6_data == {"VNI": 1, "VtepMAC": OWN_MAC6, "PublicKey": KEY, "Port": 51821}
    # The full-MTU probe fits the smallest kept device: flannel-wg-v6's.
    assert kept_devices_mtu(ctx) == 1420
    # The wireguard peer (no VTEP yet: it dropped them), seeing our lease, keeps our IPv6
    # half on its flannel-wg-v6.
    as_peer = replace(OWN_VXLAN, attrs=attrs)
    their_plan = WireguardBackend().plan(
        peer_node(2, "wireguard", PEER_KEY), [wg_peer], [as_peer], None
    )
    assert not their_plan.unreachable
    assert subnet6(1) not in v6_routes(their_plan)
    assert KEY in wg_device(their_plan, "flannel-wg-v6")


def test_once_no_peer_runs_wireguard_both_devices_leave_the_plan() -> None:
    vxlan_peer = dual_peer(3, "vxlan")
    ctx = keeping_context(node("vxlan"), "vxlan", [vxlan_peer], device_up=True)
    base = VxlanBackend().plan(ctx, [OWN_VXLAN], [vxlan_peer], OWN_MAC)
    desired = plan_kept(ctx, [OWN_VXLAN], [vxlan_peer], base)
    assert not desired.wireguard
    assert Route(NET6, IPv6Address(0), "flannel-wg-v6") not in desired.routes
    attrs = with_kept_key(ctx, VxlanBackend().lease_attrs(ctx, OWN_MAC))
    assert "PublicKey" not in (attrs.backend_v6_data or {})
