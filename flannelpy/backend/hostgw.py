"""host-gw: one route per peer, ``peer-subnet via peer-PublicIP dev <underlay>``.

No encapsulation, so the overlay MTU is the underlay's. Requires every node on
one L2 segment; a peer that is not is reported (Unreachable), never routed
into a black hole.
"""

from __future__ import annotations

from collections.abc import Sequence

from flannelpy.backend.base import NodeContext, direct_route, routable_peers
from flannelpy.dataplane.state import DesiredState, Route, Unreachable
from flannelpy.subnet.lease import Lease, LeaseAttrs


class HostGwBackend:
    type_name = "host-gw"

    def mtu(self, ctx: NodeContext) -> int:
        return ctx.config.backend.mtu or ctx.underlay.mtu

    def device_names(self, ctx: NodeContext) -> tuple[str, ...]:
        return ()

    def lease_attrs(self, ctx: NodeContext, vtep_mac: str | None) -> LeaseAttrs:
        return LeaseAttrs(
            public_ip=ctx.public_ip,
            backend_type=self.type_name,
            node_name=ctx.node_name,
            mtu=self.mtu(ctx),
        )

    def plan(
        self, ctx: NodeContext, own: Sequence[Lease], peers: Sequence[Lease], vtep_mac: str | None
    ) -> DesiredState:
        routes: set[Route] = set()
        unreachable: set[Unreachable] = set()
        for peer in routable_peers(ctx, own, peers):
            path = direct_route(ctx, peer)
            if isinstance(path, Route):
                routes.add(path)
            else:
                unreachable.add(path)
        return DesiredState(routes=frozenset(routes), unreachable=frozenset(unreachable))
