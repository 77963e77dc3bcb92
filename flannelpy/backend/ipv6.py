"""The IPv6 half of a dual-stack node's plan (pure), merged into each backend's plan.

Flannel runs the two families side by side, each over its own underlay family:

- vxlan: a second device ``flannel-v6.<VNI>`` with the node's IPv6 underlay address
  as local address, carrying the lease's IPv6 network address as /128; per peer the
  same three entries as over IPv4 (:mod:`flannelpy.backend.vxlan`), in the same order:
  neighbour ``S6.network → M6``, FDB ``M6 → dst PublicIPv6``, route ``S6 via
  S6.network dev flannel-v6.<VNI> onlink``. ``M6`` is the peer's BackendV6Data VtepMAC.
- host-gw and DirectRouting: ``S6 via PublicIPv6 dev <underlay>`` for a peer whose
  PublicIPv6 is on one of the underlay's connected IPv6 subnets.

Each pair's path is chosen per family by the same symmetric rule
(:func:`~flannelpy.backend.paths.choose_path`), from the IPv6 capabilities of both
ends: a VTEP over IPv6 counts only with BackendV6Data's VNI and VtepMAC.

VXLAN over IPv6 costs 70 bytes (outer IPv6 40 + UDP 8 + VXLAN 8 + inner Ethernet 14),
not the 50 of IPv4. Flannel subtracts 50 for both, so its full-size packets over an
IPv6 underlay do not fit; ours get MTU underlay−70 on ``flannel-v6.<VNI>``, and a
dual-stack node's overlay MTU (pods, subnet.env) is the smaller of the two families'.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from ipaddress import IPv4Network, IPv6Interface, IPv6Network
from typing import TypeVar

from flannelpy.backend.base import (
    NO_ENTRIES,
    NodeContext,
    PeerEntries,
    PlanMemo,
    held_on_vxlan,
    is_routable,
    own_networks,
    peer_entries,
    vxlan_link,
)
from flannelpy.backend.paths import (
    Capabilities,
    NoPath,
    choose_path,
    own_capabilities,
    peer_capabilities_v6,
)
from flannelpy.dataplane.state import (
    Address,
    DesiredState,
    FdbEntry,
    Neighbour,
    Route,
    Unreachable,
    VxlanLink,
    blackhole_route,
)
from flannelpy.subnet.lease import Lease

T = TypeVar("T")

VXLAN6_ENCAP_OVERHEAD = 70  # outer Ethernet 14 + IPv6 40 + UDP 8 + VXLAN 8
FLANNELD_VXLAN6_OVERHEAD = 50  # what flanneld subtracts over IPv6 (its gap: 20 bytes short)


def device_name_v6(vni: int) -> str:
    return f"flannel-v6.{vni}"


def enabled(ctx: NodeContext) -> bool:
    """This node runs IPv6: the config enables it and we have an IPv6 underlay address."""
    return ctx.config.enable_ipv6 and ctx.underlay.ip6 is not None


def vtep6_mtu(ctx: NodeContext) -> int:
    return (ctx.config.backend.mtu or ctx.underlay.mtu) - VXLAN6_ENCAP_OVERHEAD


def vtep6_mac(ctx: NodeContext, vtep_mac: str | None) -> str | None:
    """The IPv6 VTEP's MAC. Dual stack: the IPv4 VTEP's (``vtep_mac``) with bit 2 of the
    first octet flipped, so still unicast and locally administered. Flannel's two devices
    each get their own MAC, so BackendData and BackendV6Data name different ones; here
    too, and the IPv6 one is as stable across restarts as the IPv4 one (in Kubernetes mode
    read back from the Node's backend-data), through that one mechanism. IPv6-only:
    ``vtep_mac`` itself, the node's only VTEP."""
    if vtep_mac is None or not ctx.config.enable_ipv4:
        return vtep_mac
    first, rest = vtep_mac.split(":", 1)
    return f"{int(first, 16) ^ 0x04:02x}:{rest}"


def vtep6_link(ctx: NodeContext, vtep_mac: str | None) -> VxlanLink | None:
    """``flannel-v6.<VNI>`` over the IPv6 underlay with :func:`vtep6_mac`, or None
    without IPv6; ``vtep_mac`` is the IPv4 VTEP's."""
    if not enabled(ctx):
        return None
    assert ctx.underlay.ip6 is not None
    return vxlan_link(
        ctx,
        device_name_v6(ctx.config.backend.vni),
        ctx.underlay.ip6,
        vtep6_mtu(ctx),
        vtep6_mac(ctx, vtep_mac),
    )


def backend_v6_data(ctx: NodeContext, vtep_mac: str | None) -> dict[str, object] | None:
    """BackendV6Data as flanneld writes it for vxlan: ``{"VNI", "VtepMAC"}``, the MAC
    :func:`vtep6_mac` of the IPv4 VTEP's ``vtep_mac``."""
    if not enabled(ctx) or vtep_mac is None:
        return None
    return {"VNI": ctx.config.backend.vni, "VtepMAC": vtep6_mac(ctx, vtep_mac)}


def own_capabilities_v6(ctx: NodeContext) -> Capabilities:
    """Ours, as :func:`~flannelpy.backend.base.plan_peers` takes them (the VTEP is set
    from the IPv6 device in :func:`plan_ipv6`); a kept WireGuard device counts, as in IPv4."""
    return own_capabilities(ctx.config.backend, None, ctx.keeps_wireguard)


def plan_ipv6(
    ctx: NodeContext,
    own: Sequence[Lease],
    peers: Sequence[Lease],
    caps: Capabilities,
    link6: VxlanLink | None,
    memo: PlanMemo | None = None,
) -> DesiredState:
    """The IPv6 entries: a path per routable peer that has an IPv6 subnet and PublicIPv6.

    ``caps`` are our capabilities (prefers direct, wireguard); our IPv6 VTEP is
    ``link6``. ``memo`` keeps each peer's entries for the next plan."""
    if not enabled(ctx) or not any(lease.ipv6_subnet is not None for lease in own):
        return DesiredState()
    caps6 = replace(caps, vni=link6.vni if link6 else None, vtep_mac=link6.mac if link6 else None)
    own6 = [lease.ipv6_subnet for lease in own if lease.ipv6_subnet is not None]
    own_nets = own_networks(own)

    def one(peer: Lease) -> PeerEntries:
        return _peer_path6(ctx, own_nets, caps6, link6, peer)

    planned = peer_entries(peers, (ctx, own_nets, caps6, link6), one, memo.v6 if memo else None)
    routes = planned.routes
    if ctx.blackhole_own_subnets:
        routes |= {blackhole_route(net) for net in own6}
    links = [link6] if link6 else []
    return replace(
        planned,
        links=frozenset(links),
        addresses=frozenset(
            Address(link.name, IPv6Interface(f"{net.network_address}/128"))
            for link in links
            for net in own6
        ),
        routes=routes,
        owned_devices=frozenset(link.name for link in links),
    )


def _peer_path6(
    ctx: NodeContext,
    own_nets: Sequence[IPv4Network | IPv6Network],
    caps6: Capabilities,
    link6: VxlanLink | None,
    peer: Lease,
) -> PeerEntries:
    """One peer's IPv6 entries in :func:`plan_ipv6`."""
    subnet6, ip6, vtep6 = peer.ipv6_subnet, peer.attrs.public_ipv6, peer.vtep_ip6
    if subnet6 is None or ip6 is None or vtep6 is None:
        return NO_ENTRIES  # an IPv4-only peer: nothing to route in IPv6
    if not is_routable(ctx, own_nets, peer) or ip6 == ctx.underlay.ip6:
        return NO_ENTRIES
    on_link = ctx.underlay.on_link(ip6)
    peer_caps = peer_capabilities_v6(peer, ctx.config.flanneld_backend.direct_routing)
    path = choose_path(caps6, peer_caps, on_link)
    if isinstance(path, NoPath):
        where = "on" if on_link else "not on"
        reason = (
            f"no IPv6 path to peer {ip6}, which is {where} an IPv6 subnet of "
            f"{ctx.underlay.name}: {path.reason}"
        )
        return PeerEntries(unreachable=(Unreachable(subnet=subnet6, public_ip=ip6, reason=reason),))
    if path == "wireguard" and not held_on_vxlan(ctx, peer, peer_caps, caps6.vni, ipv6=True):
        return NO_ENTRIES  # flannel-wg-v6's peer (backend.wireguard), under its one route
    if path == "direct":
        return PeerEntries(routes=(Route(dst=subnet6, gateway=ip6, ifname=ctx.underlay.name),))
    # vxlan, or a wireguard pair held on vxlan until flannel-wg-v6's handshake: both ends
    # then have an IPv6 VTEP of one VNI (its MAC is the peer's BackendV6Data's).
    assert link6 is not None and peer_caps.vtep_mac is not None
    return PeerEntries(
        routes=(Route(dst=subnet6, gateway=vtep6, ifname=link6.name, onlink=True),),
        neighbours=(Neighbour(link6.name, vtep6, peer_caps.vtep_mac),),
        fdb=(FdbEntry(link6.name, peer_caps.vtep_mac, ip6),),
    )


def merge(a: DesiredState, b: DesiredState) -> DesiredState:
    """Both families' entries in one plan (their keys never collide: families differ)."""
    return DesiredState(
        links=_union(a.links, b.links),
        addresses=_union(a.addresses, b.addresses),
        routes=_union(a.routes, b.routes),
        neighbours=_union(a.neighbours, b.neighbours),
        fdb=_union(a.fdb, b.fdb),
        owned_devices=_union(a.owned_devices, b.owned_devices),
        unreachable=_union(a.unreachable, b.unreachable),
        deltas=a.deltas + b.deltas,  # those of a family alone still name their sets
    )


def _union(a: frozenset[T], b: frozenset[T]) -> frozenset[T]:
    """``a | b``, without copying thousands of entries when one family has none."""
    if not b:
        return a
    if not a:
        return b
    return a | b
