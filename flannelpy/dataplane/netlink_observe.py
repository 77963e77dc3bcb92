"""What the kernel holds of ours, read back for the reconciler: our vxlan devices, their
addresses, our routes (and those of a Flannel before us, once adopted), and the permanent
neighbours and FDB entries on our devices.
"""

from __future__ import annotations

from collections.abc import Iterable
from ipaddress import (
    IPv4Address,
    IPv4Interface,
    IPv4Network,
    IPv6Address,
    IPv6Interface,
    IPv6Network,
    ip_network,
)

from flannelpy.dataplane import nlbatch as nl
from flannelpy.dataplane import rtnl
from flannelpy.dataplane.adopt import FlannelRouteShape
from flannelpy.dataplane.state import (
    Address,
    FdbEntry,
    Neighbour,
    ObservedState,
    Route,
    VxlanLink,
)

NO_GATEWAY = IPv4Address(0)  # stands in for a route of ours that has no gateway


def observe(
    link_names: Iterable[str],
    owned_devices: Iterable[str],
    protocol: int,
    adopt: FlannelRouteShape | None,
) -> ObservedState:
    """:meth:`~flannelpy.dataplane.kernel.Kernel.observe`: routes of ``protocol`` are ours,
    and those ``adopt`` matches are reported with their own protocol."""
    with nl.NetlinkSocket(strict=True) as sock:
        rows = nl.dump_links(sock)
        names = {r.index: r.name for r in rows}
        by_name = {r.name: r for r in rows}
        wanted = [by_name[n] for n in dict.fromkeys(link_names) if n in by_name]
        links = [vxlan_link(r, names) for r in wanted if r.kind == "vxlan"]
        link_index = {r.index for r in wanted if r.kind == "vxlan"}
        addresses: list[Address] = [
            Address(names[a.ifindex], IPv4Interface(f"{a.address}/{a.prefixlen}"))
            for a in nl.dump_addresses(sock)
            if a.ifindex in link_index
        ]
        # Our IPv6 VTEP address only: the kernel's own link-local ones are not ours.
        addresses += [
            Address(names[a6.ifindex], IPv6Interface(f"{a6.address}/{a6.prefixlen}"))
            for a6 in (nl.dump_addresses6(sock) if link_index else ())
            if a6.ifindex in link_index and not a6.address.is_link_local
        ]
        route_rows = nl.dump_routes(sock, protocol=0 if adopt else protocol)
        route_rows += nl.dump_routes(sock, protocol=protocol, family=rtnl.AF_INET6)
        routes = [
            Route(
                dst=ip_network((int(r.dst), r.dst_len), strict=False)
                if r.dst.version == 4
                else IPv6Network((int(r.dst), r.dst_len), strict=False),
                gateway=r.gateway or (NO_GATEWAY if r.dst.version == 4 else IPv6Address(0)),
                ifname=names.get(r.oif, ""),
                onlink=bool(r.flags & rtnl.RTNH_F_ONLINK),
                protocol=None if r.protocol == protocol else r.protocol,
                blackhole=r.route_type == rtnl.RTN_BLACKHOLE,
            )
            for r in route_rows
            if r.protocol == protocol or adoptable(adopt, r, names)
        ]
        neighbours: list[Neighbour] = []
        fdb: list[FdbEntry] = []
        for dev in dict.fromkeys(owned_devices):
            if dev in by_name:
                neighbours += _permanent_neighbours(sock, by_name[dev].index, dev)
                fdb += _permanent_fdb(sock, by_name[dev].index, dev)
    return ObservedState(
        links=frozenset(links),
        addresses=frozenset(addresses),
        routes=frozenset(routes),
        neighbours=frozenset(neighbours),
        fdb=frozenset(fdb),
    )


def link_mac(name: str) -> str | None:
    with nl.NetlinkSocket() as sock:
        row = nl.get_link(sock, name)
    return row.mac if row is not None else None


def adoptable(adopt: FlannelRouteShape | None, r: rtnl.RouteRow, names: dict[int, str]) -> bool:
    """A route another Flannel left, which a replace of ours may take over (IPv4 only)."""
    if adopt is None or not isinstance(r.dst, IPv4Address):
        return False
    if r.gateway is not None and not isinstance(r.gateway, IPv4Address):
        return False
    dst = IPv4Network((int(r.dst), r.dst_len), strict=False)
    return adopt.adoptable(dst, r.gateway or None, names.get(r.oif, ""), r.protocol)


def vxlan_link(row: rtnl.LinkRow, names: dict[int, str]) -> VxlanLink:
    """A vxlan device as the kernel reports it; ``names`` maps ifindex to name."""
    v = row.vxlan
    vni = rtnl.U32.unpack(v[rtnl.IFLA_VXLAN_ID])[0] if rtnl.IFLA_VXLAN_ID in v else 0
    under = rtnl.U32.unpack(v[rtnl.IFLA_VXLAN_LINK])[0] if rtnl.IFLA_VXLAN_LINK in v else 0
    port = rtnl.BE16.unpack(v[rtnl.IFLA_VXLAN_PORT])[0] if rtnl.IFLA_VXLAN_PORT in v else 0
    learning = v.get(rtnl.IFLA_VXLAN_LEARNING, b"\0")
    return VxlanLink(
        name=row.name,
        vni=vni,
        local_ip=(
            rtnl.ipv4(v.get(rtnl.IFLA_VXLAN_LOCAL))
            or rtnl.ipv6(v.get(rtnl.IFLA_VXLAN_LOCAL6))
            or IPv4Address(0)
        ),
        underlay=names.get(under, ""),
        port=port,
        mtu=row.mtu,
        mac=row.mac,
        gbp=rtnl.IFLA_VXLAN_GBP in v,
        learning=bool(learning[0]),
    )


def _permanent_neighbours(sock: nl.NetlinkSocket, ifindex: int, dev: str) -> list[Neighbour]:
    return [
        Neighbour(dev, r.dst, r.lladdr)
        for family in (rtnl.AF_INET, rtnl.AF_INET6)
        for r in nl.dump_neighbours(sock, family, ifindex)
        if r.state & rtnl.NUD_PERMANENT and r.dst is not None and r.lladdr is not None
    ]


def _permanent_fdb(sock: nl.NetlinkSocket, ifindex: int, dev: str) -> list[FdbEntry]:
    return [
        FdbEntry(dev, r.lladdr, r.dst)
        for r in nl.dump_neighbours(sock, rtnl.AF_BRIDGE, ifindex)
        if r.state & rtnl.NUD_PERMANENT and r.dst is not None and r.lladdr is not None
    ]
