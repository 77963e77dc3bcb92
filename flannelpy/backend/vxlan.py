"""vxlan: Flannel's VXLAN data path, with DirectRouting as the hybrid mode.

The kernel recipe, per peer lease (subnet S, VTEP MAC M, public IP P):

1. neighbour  ``S.network → M`` on flannel.<VNI>, permanent;
2. FDB entry  ``M → dst P`` on flannel.<VNI>, permanent;
3. route      ``S via S.network dev flannel.<VNI> onlink``.

The route goes last: once it exists the kernel may send to S, and with the
neighbour and FDB entry already there it never has to ARP or flood. The
device has learning off and carries our own lease's network address as /32,
a source address for host-to-pod traffic that peers can route back to.

DirectRouting: a peer whose public IP is on our L2 segment gets host-gw's
direct route instead, and no vxlan entries. A peer that advertises no VTEP
(a host-gw node) is reached directly when it is on our segment, else reported.
"""

from __future__ import annotations

from collections.abc import Sequence
from ipaddress import IPv4Interface

from flannelpy.backend.base import NodeContext, direct_route, routable_peers
from flannelpy.config import VXLAN_ENCAP_OVERHEAD
from flannelpy.dataplane.state import (
    Address,
    DesiredState,
    FdbEntry,
    Neighbour,
    Route,
    Unreachable,
    VxlanLink,
)
from flannelpy.subnet.lease import Lease, LeaseAttrs


def device_name(vni: int) -> str:
    return f"flannel.{vni}"


class VxlanBackend:
    type_name = "vxlan"

    def mtu(self, ctx: NodeContext) -> int:
        return (ctx.config.backend.mtu or ctx.underlay.mtu) - VXLAN_ENCAP_OVERHEAD

    def device_names(self, ctx: NodeContext) -> tuple[str, ...]:
        return (device_name(ctx.config.backend.vni),)

    def lease_attrs(self, ctx: NodeContext, vtep_mac: str | None) -> LeaseAttrs:
        return LeaseAttrs(
            public_ip=ctx.public_ip,
            backend_type=self.type_name,
            backend_data={"VNI": ctx.config.backend.vni, "VtepMAC": vtep_mac},
            node_name=ctx.node_name,
            mtu=self.mtu(ctx),
        )

    def link(self, ctx: NodeContext, vtep_mac: str | None) -> VxlanLink:
        backend = ctx.config.backend
        return VxlanLink(
            name=device_name(backend.vni),
            vni=backend.vni,
            local_ip=ctx.underlay.ip,
            underlay=ctx.underlay.name,
            port=backend.effective_port,
            mtu=self.mtu(ctx),
            mac=vtep_mac,
            gbp=backend.gbp,
            learning=backend.learning,
        )

    def plan(
        self, ctx: NodeContext, own: Sequence[Lease], peers: Sequence[Lease], vtep_mac: str | None
    ) -> DesiredState:
        link = self.link(ctx, vtep_mac)
        dev = link.name
        addresses = {Address(dev, IPv4Interface(f"{lease.vtep_ip}/32")) for lease in own}
        routes: set[Route] = set()
        neighbours: set[Neighbour] = set()
        fdb: set[FdbEntry] = set()
        unreachable: set[Unreachable] = set()
        direct_routing = ctx.config.backend.direct_routing
        for peer in routable_peers(ctx, own, peers):
            peer_mac = peer.attrs.vtep_mac if peer.attrs.backend_type == "vxlan" else None
            on_link = ctx.underlay.on_link(peer.attrs.public_ip)
            if peer_mac is None or (direct_routing and on_link):
                path = direct_route(ctx, peer)
                if isinstance(path, Route):
                    routes.add(path)
                else:
                    unreachable.add(path)
                continue
            neighbours.add(Neighbour(dev, peer.vtep_ip, peer_mac))
            fdb.add(FdbEntry(dev, peer_mac, peer.attrs.public_ip))
            routes.add(Route(dst=peer.subnet, gateway=peer.vtep_ip, ifname=dev, onlink=True))
        return DesiredState(
            links=frozenset({link}),
            addresses=frozenset(addresses),
            routes=frozenset(routes),
            neighbours=frozenset(neighbours),
            fdb=frozenset(fdb),
            owned_devices=frozenset({dev}),
            unreachable=frozenset(unreachable),
        )
