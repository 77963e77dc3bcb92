"""The backend protocol: a backend is a pure planner of desired kernel state.

It advertises what peers need to reach this node (LeaseAttrs) and turns our
leases plus peer leases into a :class:`DesiredState`. It never touches the
kernel; the reconciler does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from ipaddress import IPv4Address
from typing import Protocol

from flannelpy.config import NetworkConfig
from flannelpy.dataplane.state import DesiredState, Route, UnderlayInterface, Unreachable
from flannelpy.subnet.lease import Lease, LeaseAttrs


@dataclass(frozen=True)
class NodeContext:
    """What a backend knows about the node it plans for."""

    config: NetworkConfig
    underlay: UnderlayInterface
    public_ip: IPv4Address  # advertised to peers; the underlay address unless --public-ip
    node_name: str


class Backend(Protocol):
    type_name: str

    def mtu(self, ctx: NodeContext) -> int:
        """The overlay MTU: what pods and subnet.env get."""
        ...

    def device_names(self, ctx: NodeContext) -> tuple[str, ...]:
        """Devices this backend creates and owns entirely."""
        ...

    def lease_attrs(self, ctx: NodeContext, vtep_mac: str | None) -> LeaseAttrs: ...

    def plan(
        self, ctx: NodeContext, own: Sequence[Lease], peers: Sequence[Lease], vtep_mac: str | None
    ) -> DesiredState: ...


def routable_peers(ctx: NodeContext, own: Sequence[Lease], peers: Sequence[Lease]) -> list[Lease]:
    """Peers worth a path: not ourselves under another key, not overlapping our own subnets.

    A peer lease that advertises our own address is a stale lease of this node
    (re-created, or left by a previous run); routing to it would loop.
    """
    own_nets = [lease.subnet for lease in own]
    return [
        peer
        for peer in peers
        if peer.attrs.public_ip != ctx.public_ip
        and not any(peer.subnet.overlaps(net) for net in own_nets)
    ]


def direct_route(ctx: NodeContext, peer: Lease) -> Route | Unreachable:
    """host-gw's path: the peer's subnet via its address, if that address is on our L2 segment."""
    if ctx.underlay.on_link(peer.attrs.public_ip):
        return Route(dst=peer.subnet, gateway=peer.attrs.public_ip, ifname=ctx.underlay.name)
    return Unreachable(
        subnet=peer.subnet,
        public_ip=peer.attrs.public_ip,
        reason=(
            f"peer {peer.attrs.public_ip} is not on a subnet of {ctx.underlay.name} "
            f"({', '.join(str(n) for n in ctx.underlay.networks) or 'none'}); host-gw needs "
            "every node on one L2 segment: use vxlan, or vxlan with DirectRouting"
        ),
    )
