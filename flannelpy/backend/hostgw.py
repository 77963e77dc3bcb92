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
"""

from __future__ import annotations

from collections.abc import Sequence

from flannelpy.backend.base import NodeContext, plan_peers
from flannelpy.backend.paths import needs_vtep
from flannelpy.backend.vxlan import device_name, vtep_link
from flannelpy.dataplane.state import DesiredState
from flannelpy.subnet.lease import Lease, LeaseAttrs


class HostGwBackend:
    type_name = "host-gw"

    def mtu(self, ctx: NodeContext) -> int:
        return ctx.config.backend.mtu or ctx.underlay.mtu

    def device_names(self, ctx: NodeContext) -> tuple[str, ...]:
        # The transition VTEP is ours too: never treat it as a foreign device.
        return (device_name(ctx.config.backend.vni),)

    def lease_attrs(self, ctx: NodeContext, vtep_mac: str | None) -> LeaseAttrs:
        data = {"VNI": ctx.config.backend.vni, "VtepMAC": vtep_mac} if vtep_mac else None
        return LeaseAttrs(
            public_ip=ctx.public_ip,
            backend_type=self.type_name,
            backend_data=data,
            node_name=ctx.node_name,
            mtu=self.mtu(ctx),
        )

    def needs_vtep(self, ctx: NodeContext, peers: Sequence[Lease]) -> bool:
        # A lease advertising our own address is a stale one of ours, not a peer.
        others = [peer for peer in peers if peer.attrs.public_ip != ctx.public_ip]
        return needs_vtep(ctx.config.backend, others)

    def plan(
        self, ctx: NodeContext, own: Sequence[Lease], peers: Sequence[Lease], vtep_mac: str | None
    ) -> DesiredState:
        link = vtep_link(ctx, vtep_mac) if vtep_mac else None
        return plan_peers(ctx, own, peers, link)
