"""What the kernel holds of ours, read back for the reconciler: our vxlan devices, their
addresses, our routes (and those of a Flannel before us, once adopted), and the permanent
neighbours and FDB entries on our devices.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from ipaddress import (
    IPv4Address,
    IPv4Interface,
    IPv4Network,
    IPv6Address,
    IPv6Interface,
    IPv6Network,
    ip_network,
)
from itertools import chain
from typing import TypeVar

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
    expected: ObservedState | None = None,
) -> ObservedState:
    """:meth:`~flannelpy.dataplane.kernel.Kernel.observe`: routes of ``protocol`` are ours,
    and those ``adopt`` matches are reported with their own protocol. ``expected``: what
    the kernel should hold (see :func:`gather`)."""
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

        def routes() -> Iterator[Route]:
            rows = chain(
                nl.route_rows(sock, protocol=0 if adopt else protocol),
                nl.route_rows(sock, protocol=protocol, family=rtnl.AF_INET6),
            )
            for r in rows:
                if r.protocol == protocol or adoptable(adopt, r, names):
                    yield _route(r, names, protocol)

        devices = [
            (dev, by_name[dev].index) for dev in dict.fromkeys(owned_devices) if dev in by_name
        ]

        def neighbours() -> Iterator[Neighbour]:
            for dev, index in devices:
                for family in (rtnl.AF_INET, rtnl.AF_INET6):
                    for r in nl.neighbour_rows(sock, family, index):
                        if (
                            r.state & rtnl.NUD_PERMANENT
                            and r.dst is not None
                            and r.lladdr is not None
                        ):
                            yield Neighbour(dev, r.dst, r.lladdr)

        def fdb() -> Iterator[FdbEntry]:
            for dev, index in devices:
                for r in nl.neighbour_rows(sock, rtnl.AF_BRIDGE, index):
                    if r.state & rtnl.NUD_PERMANENT and r.dst is not None and r.lladdr is not None:
                        yield FdbEntry(dev, r.lladdr, r.dst)

        return ObservedState(
            links=frozenset(links),
            addresses=frozenset(addresses),
            routes=gather(routes, expected.routes if expected else None),
            neighbours=gather(neighbours, expected.neighbours if expected else None),
            fdb=gather(fdb, expected.fdb if expected else None),
        )


E = TypeVar("E", Route, Neighbour, FdbEntry)


def gather(read: Callable[[], Iterable[E]], expected: frozenset[E] | None) -> frozenset[E]:
    """The entries ``read`` yields (one dump, read again while the kernel says it changed
    under it), as a set; ``expected`` itself when they are exactly it.

    Why: every entry a dump finds equal to an expected one is dropped as soon as it is
    compared, so a dump of the kernel as planned (most are: the timer's, the one after a
    new device) holds only one entry at a time and leaves no peak of thousands of objects
    in the allocator's arenas, and the diff then compares the plan's set with itself.
    Exact: the hashes of the matched entries prove that every expected entry was found
    (expected entries of one hash, almost never seen, are read again without it)."""
    if expected is None:
        return nl.retrying(lambda: frozenset(read()))
    matched, extra = nl.retrying(lambda: _compare(read(), expected))
    if not extra and len(matched) == len(expected):
        return expected  # each expected hash, each hash an expected entry's: all of them
    missing = frozenset(entry for entry in expected if hash(entry) not in matched)
    if len(matched) + len(missing) != len(expected):  # two expected entries share a hash
        return nl.retrying(lambda: frozenset(read()))
    return (expected - missing) | frozenset(extra)


def _compare(entries: Iterable[E], expected: frozenset[E]) -> tuple[set[int], list[E]]:
    """(hashes of the entries that are expected, the entries that are not)."""
    matched: set[int] = set()
    extra: list[E] = []
    for entry in entries:
        if entry in expected:
            matched.add(hash(entry))
        else:
            extra.append(entry)
    return matched, extra


def _route(r: rtnl.RouteRow, names: dict[int, str], protocol: int) -> Route:
    return Route(
        dst=ip_network((int(r.dst), r.dst_len), strict=False)
        if r.dst.version == 4
        else IPv6Network((int(r.dst), r.dst_len), strict=False),
        gateway=r.gateway or (NO_GATEWAY if r.dst.version == 4 else IPv6Address(0)),
        ifname=names.get(r.oif, ""),
        onlink=bool(r.flags & rtnl.RTNH_F_ONLINK),
        protocol=None if r.protocol == protocol else r.protocol,
        blackhole=r.route_type == rtnl.RTN_BLACKHOLE,
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
