"""vxlan: Flannel's VXLAN data path, with DirectRouting as the hybrid mode.

The kernel recipe, per peer reached through vxlan (subnet S, VTEP MAC M,
public IP P):

1. neighbour  ``S.network → M`` on flannel.<VNI>, permanent;
2. FDB entry  ``M → dst P`` on flannel.<VNI>, permanent;
3. route      ``S via S.network dev flannel.<VNI> onlink``.

The route goes last: once it exists the kernel may send to S, and with the
neighbour and FDB entry already there it never has to ARP or flood. The
device (the VTEP) has learning off, MTU underlay−50, and carries our own
lease's network address as /32, a source address for host-to-pod traffic that
peers can route back to.

Which peers get this recipe and which get a direct route
``S via P dev <underlay>`` is decided per pair by the symmetric rule in
:mod:`flannelpy.backend.paths`: a peer on our L2 segment is routed directly when
either end prefers it (we have DirectRouting, or the peer is host-gw or
advertises DirectRouting) or either end has no VTEP; any other peer is
encapsulated when it advertises a VTEP with our VNI, else reported unreachable.
The same planner (:func:`~flannelpy.backend.base.plan_peers`) serves host-gw
nodes, which borrow this module's device while a peer is still vxlan.

Dual stack adds ``flannel-v6.<VNI>`` over the IPv6 underlay, the same recipe per
peer in IPv6 (:mod:`flannelpy.backend.ipv6`); the overlay MTU is then the smaller
of underlay−50 (IPv4) and underlay−70 (IPv6).
"""

from __future__ import annotations

from collections.abc import Sequence

from flannelpy.backend import ipv6
from flannelpy.backend.base import NodeContext, PlanMemo, plan_peers, vxlan_link
from flannelpy.config.netconf import VXLAN_ENCAP_OVERHEAD
from flannelpy.dataplane.state import DesiredState, VxlanLink
from flannelpy.subnet.lease import Lease, LeaseAttrs


def device_name(vni: int) -> str:
    return f"flannel.{vni}"


def vtep_mtu(ctx: NodeContext) -> int:
    return (ctx.config.backend.mtu or ctx.underlay.mtu) - VXLAN_ENCAP_OVERHEAD


def overlay_mtu(ctx: NodeContext) -> int:
    """What pods get: one MTU for both families, so the smaller one in dual stack
    (IPv6-only: the IPv6 VTEP's)."""
    if not ctx.config.enable_ipv4:
        return ipv6.vtep6_mtu(ctx)
    if ipv6.enabled(ctx):
        return min(vtep_mtu(ctx), ipv6.vtep6_mtu(ctx))
    return vtep_mtu(ctx)


def vtep_link(ctx: NodeContext, vtep_mac: str | None) -> VxlanLink | None:
    """The IPv4 VTEP device, the same under vxlan and (during a transition) under
    host-gw; None IPv6-only (no IPv4 underlay address)."""
    if not ctx.config.enable_ipv4 or ctx.underlay.ip is None:
        return None
    return vxlan_link(
        ctx, device_name(ctx.config.backend.vni), ctx.underlay.ip, vtep_mtu(ctx), vtep_mac
    )


class VxlanBackend:
    type_name = "vxlan"

    def mtu(self, ctx: NodeContext) -> int:
        return overlay_mtu(ctx)

    def device_names(self, ctx: NodeContext) -> tuple[str, ...]:
        vni = ctx.config.backend.vni
        return (device_name(vni), ipv6.device_name_v6(vni))

    def lease_attrs(self, ctx: NodeContext, vtep_mac: str | None) -> LeaseAttrs:
        return LeaseAttrs(
            public_ip=ctx.public_ip,
            backend_type=self.type_name,
            # IPv6-only: the IPv4 VTEP does not exist; BackendV6Data carries the MAC.
            backend_data=(
                {"VNI": ctx.config.backend.vni, "VtepMAC": vtep_mac}
                if ctx.config.enable_ipv4
                else None
            ),
            public_ipv6=ctx.public_ipv6 if ipv6.enabled(ctx) else None,
            backend_v6_data=ipv6.backend_v6_data(ctx, vtep_mac),
            node_name=ctx.node_name,
            mtu=self.mtu(ctx),
            # Peers on our segment route to us directly too, so both directions match.
            direct_routing=True if ctx.config.backend.direct_routing else None,
        )

    def needs_vtep(self, ctx: NodeContext, peers: Sequence[Lease]) -> bool:
        return True

    def plan(
        self,
        ctx: NodeContext,
        own: Sequence[Lease],
        peers: Sequence[Lease],
        vtep_mac: str | None,
        memo: PlanMemo | None = None,
    ) -> DesiredState:
        link = vtep_link(ctx, vtep_mac)
        v6 = ipv6.plan_ipv6(
            ctx,
            own,
            peers,
            ipv6.own_capabilities_v6(ctx),
            ipv6.vtep6_link(ctx, vtep_mac),
            memo,
        )
        return ipv6.merge(plan_peers(ctx, own, peers, link, memo), v6)
