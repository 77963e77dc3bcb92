"""host-gw: one route per peer, ``peer-subnet via peer-PublicIP dev <underlay>``.

No encapsulation, so the overlay MTU (pods, subnet.env) is the underlay's.
Alone it requires every node on one L2 segment; a peer that is not is
reported (Unreachable), never routed into a black hole.

In a mixed cluster (a rollout from or to vxlan) a host-gw node also keeps
vxlan's VTEP device (``flannel.<VNI>``, MTU underlay−50, our lease's network
address /32) while any peer lease is still vxlan, because such a peer may
encapsulate to us, and advertises it in BackendData {"VNI", "VtepMAC"} (Go
flanneld ignores BackendData of host-gw leases). Each peer's path then follows
the symmetric rule of :mod:`flannelpy.backend.paths`: on our segment directly
(we prefer direct), elsewhere through the VTEP when the peer has one. The
agent passes ``vtep_mac`` only while :meth:`HostGwBackend.needs_vtep` says so;
without it there is no device, and the agent removes a leftover one.

Dual stack: ``peer-subnet6 via peer-PublicIPv6 dev <underlay>`` per peer too
(:mod:`flannelpy.backend.ipv6`), and ``flannel-v6.<VNI>`` while a peer is vxlan.
"""

from __future__ import annotations

from collections.abc import Sequence

from flannelpy.backend import ipv6
from flannelpy.backend.base import NodeContext, PlanMemo, node_needs_vtep, plan_peers
from flannelpy.backend.vxlan import device_name, vtep_link
from flannelpy.dataplane.state import DesiredState
from flannelpy.subnet.lease import Lease, LeaseAttrs


class HostGwBackend:
    type_name = "host-gw"

    def mtu(self, ctx: NodeContext) -> int:
        return ctx.config.backend.mtu or ctx.underlay.mtu

    def device_names(self, ctx: NodeContext) -> tuple[str, ...]:
        # The transition VTEPs are ours too: never treat them as foreign devices.
        vni = ctx.config.backend.vni
        return (device_name(vni), ipv6.device_name_v6(vni))

    def lease_attrs(self, ctx: NodeContext, vtep_mac: str | None) -> LeaseAttrs:
        data = (
            {"VNI": ctx.config.backend.vni, "VtepMAC": vtep_mac}
            if vtep_mac and ctx.config.enable_ipv4
            else None
        )
        return LeaseAttrs(
            public_ip=ctx.public_ip,
            backend_type=self.type_name,
            backend_data=data,
            public_ipv6=ctx.public_ipv6 if ipv6.enabled(ctx) else None,
            backend_v6_data=ipv6.backend_v6_data(ctx, vtep_mac),
            node_name=ctx.node_name,
            mtu=self.mtu(ctx),
        )

    def needs_vtep(self, ctx: NodeContext, peers: Sequence[Lease]) -> bool:
        return node_needs_vtep(ctx, peers)

    def plan(
        self,
        ctx: NodeContext,
        own: Sequence[Lease],
        peers: Sequence[Lease],
        vtep_mac: str | None,
        memo: PlanMemo | None = None,
    ) -> DesiredState:
        link = vtep_link(ctx, vtep_mac) if vtep_mac else None
        v6 = ipv6.plan_ipv6(
            ctx,
            own,
            peers,
            ipv6.own_capabilities_v6(ctx),
            ipv6.vtep6_link(ctx, vtep_mac) if vtep_mac else None,
            memo,
        )
        return ipv6.merge(plan_peers(ctx, own, peers, link, memo), v6)
