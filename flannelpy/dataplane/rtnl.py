"""rtnetlink's vocabulary, hand-packed: constants, message layouts, the requests we
send (neighbours, FDB entries, routes, links, addresses) and the rows we decode
from dumps.

Pure (de)serialisation with :mod:`struct`, no socket (that is :mod:`.nlbatch`):
packing by hand is what makes a batch of thousands of neighbours, FDB entries
and routes cheap, and a pod's ADD (a handful of requests) fast, and decoding
only the attributes the adapter needs is what makes a dump of thousands of
entries cheap. The byte layouts follow
linux/netlink.h, linux/rtnetlink.h, linux/neighbour.h and linux/if_link.h;
tests/unit/test_nlbatch_golden.py holds every packed request against pyroute2's
own encoding.
"""

from __future__ import annotations

import socket
import struct
from dataclasses import dataclass, field
from ipaddress import (
    IPv4Address,
    IPv4Interface,
    IPv4Network,
    IPv6Address,
    IPv6Interface,
    IPv6Network,
)
from typing import NamedTuple

# --- netlink / rtnetlink constants (linux/netlink.h, linux/rtnetlink.h, linux/neighbour.h)
NLMSG_ERROR = 2
NLMSG_DONE = 3
NLM_F_REQUEST = 0x1
NLM_F_MULTI = 0x2
NLM_F_ACK = 0x4
NLM_F_DUMP_INTR = 0x10
NLM_F_ACK_TLVS = 0x200  # on NLMSG_ERROR: extended-ack attributes follow
NLM_F_ROOT = 0x100
NLM_F_MATCH = 0x200
NLM_F_DUMP = NLM_F_ROOT | NLM_F_MATCH
NLM_F_REPLACE = 0x100
NLM_F_EXCL = 0x200
NLM_F_CREATE = 0x400
NLM_F_APPEND = 0x800
NLMSGERR_ATTR_MSG = 1

RTM_NEWLINK, RTM_DELLINK, RTM_GETLINK = 16, 17, 18
RTM_NEWADDR, RTM_DELADDR, RTM_GETADDR = 20, 21, 22
RTM_NEWROUTE, RTM_DELROUTE, RTM_GETROUTE = 24, 25, 26
RTM_NEWNEIGH, RTM_DELNEIGH, RTM_GETNEIGH = 28, 29, 30

RTMGRP_LINK = 0x1
RTMGRP_NEIGH = 0x4
RTMGRP_IPV4_IFADDR = 0x10
RTMGRP_IPV4_ROUTE = 0x40
RTMGRP_IPV6_IFADDR = 0x100
RTMGRP_IPV6_ROUTE = 0x400

AF_INET = socket.AF_INET
AF_INET6 = socket.AF_INET6
AF_BRIDGE = 7

RT_TABLE_MAIN = 254
RT_SCOPE_UNIVERSE = 0
RT_SCOPE_LINK = 253
RT_SCOPE_NOWHERE = 255
RTN_UNICAST = 1
RTN_BLACKHOLE = 6
RTNH_F_ONLINK = 0x4
RTA_DST, RTA_OIF, RTA_GATEWAY, RTA_PREFSRC, RTA_TABLE = 1, 4, 5, 7, 15
RTA_PRIORITY = 6  # the route's metric

NUD_PERMANENT = 0x80
# INCOMPLETE | REACHABLE | STALE | DELAY | PROBE: states of the ARP cache's own entries
NUD_DYNAMIC = 0x01 | 0x02 | 0x04 | 0x08 | 0x10
NTF_SELF = 0x02
NDA_DST, NDA_LLADDR, NDA_IFINDEX = 1, 2, 8

IFLA_ADDRESS, IFLA_IFNAME, IFLA_MTU, IFLA_LINKINFO, IFLA_EXT_MASK = 1, 3, 4, 18, 29
IFLA_MASTER, IFLA_STATS64, IFLA_NET_NS_FD = 10, 23, 28
IFLA_IFALIAS = 20  # a link's free-text alias (IFALIASZ 256 bytes)
IFLA_INFO_SLAVE_KIND, IFLA_INFO_SLAVE_DATA = 4, 5
IFLA_BRPORT_MODE = 4  # hairpin (linux/if_link.h)
VETH_INFO_PEER = 1  # linux/veth.h
RTPROT_BOOT = 3  # what `ip route add` tags routes with
IFLA_INFO_KIND, IFLA_INFO_DATA = 1, 2
IFLA_VXLAN_ID, IFLA_VXLAN_LINK, IFLA_VXLAN_LOCAL, IFLA_VXLAN_LOCAL6 = 1, 3, 4, 17
IFLA_VXLAN_LEARNING, IFLA_VXLAN_PORT, IFLA_VXLAN_GBP = 7, 15, 23
RTEXT_FILTER_SKIP_STATS = 1 << 3
IFF_UP = 0x1
IFF_LOWER_UP = 0x10000  # carrier: the link can pass packets

IFA_ADDRESS, IFA_LOCAL, IFA_BROADCAST = 1, 2, 4
IFA_FLAGS = 8  # u32: all of the flags (the header's byte holds only the low 8 bits)
IFA_F_NODAD, IFA_F_DADFAILED, IFA_F_TENTATIVE = 0x02, 0x08, 0x40
# IPv6 addresses no endpoint is built on: privacy addresses that rotate, addresses whose
# preferred lifetime ran out (``preferred_lft 0``), and those a duplicate took.
IFA_F_TEMPORARY, IFA_F_DEPRECATED = 0x01, 0x20
IFA_F_UNSTABLE = IFA_F_TEMPORARY | IFA_F_DEPRECATED | IFA_F_DADFAILED

HDR = struct.Struct("=IHHII")  # nlmsghdr: len, type, flags, seq, pid
ATTR = struct.Struct("=HH")  # rtattr: len, type
NDMSG = struct.Struct("=BBHiHBB")  # family, pad1, pad2, ifindex, state, flags, type
RTMSG = struct.Struct(
    "=BBBBBBBBI"
)  # family, dst_len, src_len, tos, table, proto, scope, type, flags
IFINFO = struct.Struct("=BxHiII")  # family, type, index, flags, change
IFADDR = struct.Struct("=BBBBI")  # family, prefixlen, flags, scope, index
U32 = struct.Struct("=I")
I32 = struct.Struct("=i")
BE16 = struct.Struct("!H")
_BE32 = struct.Struct("!I")  # IPv4 as an int: IPv4Address(int) is 3x faster than from bytes


@dataclass(frozen=True)
class Request:
    """One rtnetlink request without its header: type, flags (REQUEST/ACK added), body."""

    msg_type: int
    flags: int
    body: bytes


@dataclass(frozen=True)
class Reply:
    """The outcome of one :class:`Request`: 0, or a positive errno and the kernel's text."""

    error: int = 0
    message: str = ""


# --- encoding ---------------------------------------------------------------


def attr(attr_type: int, payload: bytes) -> bytes:
    length = ATTR.size + len(payload)
    return ATTR.pack(length, attr_type) + payload + b"\0" * (-length & 3)


def mac_bytes(mac: str) -> bytes:
    return bytes.fromhex(mac.replace(":", ""))


def mac_text(raw: bytes) -> str:
    return raw.hex(":")


def family_of(ip: IPv4Address | IPv6Address) -> int:
    return AF_INET6 if ip.version == 6 else AF_INET


def neigh_request(
    delete: bool, ifindex: int, ip: IPv4Address | IPv6Address, mac: str | None = None
) -> Request:
    """A permanent ARP (or IPv6 neighbour) entry (replace on set); ``mac`` only for set."""
    body = NDMSG.pack(family_of(ip), 0, 0, ifindex, NUD_PERMANENT, 0, 0) + attr(NDA_DST, ip.packed)
    if delete:
        return Request(RTM_DELNEIGH, 0, body)
    assert mac is not None
    return Request(
        RTM_NEWNEIGH, NLM_F_CREATE | NLM_F_REPLACE, body + attr(NDA_LLADDR, mac_bytes(mac))
    )


def fdb_request(delete: bool, ifindex: int, mac: str, dst: IPv4Address | IPv6Address) -> Request:
    """A vxlan FDB entry, ``bridge fdb replace|del <mac> dev <dev> dst <dst> self permanent``."""
    body = (
        NDMSG.pack(AF_BRIDGE, 0, 0, ifindex, NUD_PERMANENT, NTF_SELF, 0)
        + attr(NDA_LLADDR, mac_bytes(mac))
        + attr(NDA_DST, dst.packed)
    )
    if delete:
        return Request(RTM_DELNEIGH, 0, body)
    # REPLACE, as flanneld's NeighSet: a unicast MAC has one remote, and a peer whose
    # address changed (a node re-created with its VTEP MAC) must have it moved. APPEND
    # adds remotes only to the all-zeros and multicast MACs and is a silent no-op for a
    # unicast MAC already there, which left the old address and, once that stale entry
    # was deleted, no entry at all.
    return Request(RTM_NEWNEIGH, NLM_F_CREATE | NLM_F_REPLACE, body)


def route_request(
    delete: bool,
    protocol: int,
    dst: bytes,
    dst_len: int,
    gateway: IPv4Address | IPv6Address | None = None,
    oif: int = 0,
    onlink: bool = False,
    blackhole_metric: int | None = None,
) -> Request:
    """A main-table route (IPv4, or IPv6 for a 16-byte ``dst``) tagged with ``protocol``;
    replace on set.

    A delete names only dst and protocol, so it removes our route for that
    destination whatever its next hop or type, and never a route another tool owns.
    With ``blackhole_metric`` it is a blackhole route of that metric (no device).
    """
    family = AF_INET6 if len(dst) == 16 else AF_INET
    if delete:
        head = RTMSG.pack(family, dst_len, 0, 0, RT_TABLE_MAIN, protocol, RT_SCOPE_NOWHERE, 0, 0)
        return Request(RTM_DELROUTE, 0, head + attr(RTA_DST, dst))
    if blackhole_metric is not None:
        head = RTMSG.pack(
            family, dst_len, 0, 0, RT_TABLE_MAIN, protocol, RT_SCOPE_UNIVERSE, RTN_BLACKHOLE, 0
        )
        body = head + attr(RTA_DST, dst) + attr(RTA_PRIORITY, U32.pack(blackhole_metric))
        return Request(RTM_NEWROUTE, NLM_F_CREATE | NLM_F_REPLACE, body)
    scope = RT_SCOPE_UNIVERSE if gateway is not None else RT_SCOPE_LINK
    flags = RTNH_F_ONLINK if onlink else 0
    head = RTMSG.pack(family, dst_len, 0, 0, RT_TABLE_MAIN, protocol, scope, RTN_UNICAST, flags)
    body = head + attr(RTA_DST, dst) + attr(RTA_OIF, U32.pack(oif))
    if gateway is not None:
        body += attr(RTA_GATEWAY, gateway.packed)
    return Request(RTM_NEWROUTE, NLM_F_CREATE | NLM_F_REPLACE, body)


def route_add_request(
    oif: int, gateway: IPv4Address | IPv6Address, dst: IPv4Network | IPv6Network
) -> Request:
    """``ip route add <dst> via <gateway> dev <oif>``: created only if no route to ``dst``
    exists (CREATE|EXCL), so a route another tool added is never replaced."""
    if dst.version != gateway.version:
        raise ValueError(f"route to {dst} via {gateway}: the families differ")
    route = route_request(
        False, RTPROT_BOOT, dst.network_address.packed, dst.prefixlen, gateway, oif
    )
    return Request(route.msg_type, NLM_F_CREATE | NLM_F_EXCL, route.body)


# --- links and addresses ----------------------------------------------------


def _ifinfo(index: int = 0, flags: int = 0, change: int = 0) -> bytes:
    return IFINFO.pack(socket.AF_UNSPEC, 0, index, flags, change)


def _ifname(name: str) -> bytes:
    return attr(IFLA_IFNAME, name.encode() + b"\0")


def _u32(attr_type: int, value: int) -> bytes:
    return attr(attr_type, U32.pack(value))


def bridge_request(name: str, mtu: int, mac: str) -> Request:
    """Create a bridge, up, with its MAC pinned (else it takes the lowest of its ports')."""
    body = (
        _ifinfo(flags=IFF_UP, change=IFF_UP)
        + _ifname(name)
        + _u32(IFLA_MTU, mtu)
        + attr(IFLA_ADDRESS, mac_bytes(mac))
        + attr(IFLA_LINKINFO, attr(IFLA_INFO_KIND, b"bridge"))
    )
    return Request(RTM_NEWLINK, NLM_F_CREATE | NLM_F_EXCL, body)


def veth_request(
    host: str, host_mac: str, peer: str, peer_mac: str, netns_fd: int, mtu: int, master: int
) -> Request:
    """Create a veth pair: ``host`` up in this namespace with ``master``, ``peer`` created
    directly in the namespace of ``netns_fd`` (the kernel refuses to create it up)."""
    peer_msg = (
        _ifinfo()
        + _ifname(peer)
        + _u32(IFLA_NET_NS_FD, netns_fd)
        + _u32(IFLA_MTU, mtu)
        + attr(IFLA_ADDRESS, mac_bytes(peer_mac))
    )
    info = attr(IFLA_INFO_KIND, b"veth") + attr(IFLA_INFO_DATA, attr(VETH_INFO_PEER, peer_msg))
    body = (
        _ifinfo(flags=IFF_UP, change=IFF_UP)
        + _ifname(host)
        + _u32(IFLA_MTU, mtu)
        + attr(IFLA_ADDRESS, mac_bytes(host_mac))
        + _u32(IFLA_MASTER, master)
        + attr(IFLA_LINKINFO, info)
    )
    return Request(RTM_NEWLINK, NLM_F_CREATE | NLM_F_EXCL, body)


def hairpin_request(port: str, on: bool) -> Request:
    """``ip link set <port> type bridge_slave hairpin on``, addressed by name."""
    info = attr(IFLA_INFO_SLAVE_KIND, b"bridge") + attr(
        IFLA_INFO_SLAVE_DATA, attr(IFLA_BRPORT_MODE, bytes([int(on)]))
    )
    return Request(RTM_NEWLINK, 0, _ifinfo() + _ifname(port) + attr(IFLA_LINKINFO, info))


def link_set_request(index: int, up: bool | None = None, mtu: int | None = None) -> Request:
    flags = change = 0
    if up is not None:
        flags, change = (IFF_UP if up else 0), IFF_UP
    body = _ifinfo(index, flags, change) + (_u32(IFLA_MTU, mtu) if mtu else b"")
    return Request(RTM_NEWLINK, 0, body)


def link_alias_request(name: str, alias: str) -> Request:
    return Request(RTM_NEWLINK, 0, _ifinfo() + _ifname(name) + attr(IFLA_IFALIAS, alias.encode()))


def link_delete_request(name: str) -> Request:
    return Request(RTM_DELLINK, 0, _ifinfo() + _ifname(name))


def link_delete_index_request(index: int) -> Request:
    return Request(RTM_DELLINK, 0, _ifinfo(index))


def address_request(
    index: int, address: IPv4Interface | IPv6Interface, delete: bool = False
) -> Request:
    """Add (replace) or delete an address; an IPv6 one is added without DAD (IFA_F_NODAD),
    so it never sits tentative."""
    net = address.network
    v6 = address.version == 6
    body = (
        IFADDR.pack(AF_INET6 if v6 else AF_INET, net.prefixlen, 0, RT_SCOPE_UNIVERSE, index)
        + attr(IFA_LOCAL, address.ip.packed)
        + attr(IFA_ADDRESS, address.ip.packed)
    )
    if v6 and not delete:
        body += _u32(IFA_FLAGS, IFA_F_NODAD)
    elif not v6 and net.prefixlen < 31:
        body += attr(IFA_BROADCAST, net.broadcast_address.packed)
    if delete:
        return Request(RTM_DELADDR, 0, body)
    return Request(RTM_NEWADDR, NLM_F_CREATE | NLM_F_REPLACE, body)


# --- decoding ---------------------------------------------------------------


def parse_attrs(buf: bytes, start: int, end: int) -> dict[int, bytes]:
    """rtattrs in ``buf[start:end]`` by type (nested flag stripped); later duplicates win."""
    attrs: dict[int, bytes] = {}
    unpack = ATTR.unpack_from
    while start + 4 <= end:
        length, attr_type = unpack(buf, start)
        if length < 4:
            break
        attrs[attr_type & 0x3FFF] = buf[start + 4 : start + length]
        start += (length + 3) & ~3
    return attrs


@dataclass
class LinkRow:
    index: int
    name: str
    flags: int
    mtu: int
    mac: str | None
    kind: str | None = None
    vxlan: dict[int, bytes] = field(default_factory=dict)  # IFLA_VXLAN_* attributes
    master: int = 0  # the bridge it is a port of; 0: none
    alias: str | None = None


class RouteRow(NamedTuple):  # a tuple: thousands are built per dump
    dst: IPv4Address | IPv6Address
    dst_len: int
    gateway: IPv4Address | IPv6Address | None
    oif: int
    protocol: int
    table: int
    route_type: int
    flags: int
    prefsrc: IPv4Address | IPv6Address | None = None


class NeighRow(NamedTuple):  # a tuple: thousands are built per dump
    family: int
    ifindex: int
    state: int
    flags: int
    dst: IPv4Address | IPv6Address | None
    lladdr: str | None


class AddrRow(NamedTuple):  # a tuple: thousands are built per dump
    ifindex: int
    address: IPv4Address
    prefixlen: int
    flags: int = 0  # IFA_F_*


class AddrRow6(NamedTuple):
    ifindex: int
    address: IPv6Address
    prefixlen: int
    flags: int = 0  # IFA_F_*: tentative until DAD is done


def ipv4(raw: bytes | None) -> IPv4Address | None:
    return IPv4Address(raw) if raw is not None and len(raw) == 4 else None


def ipv6(raw: bytes | None) -> IPv6Address | None:
    return IPv6Address(raw) if raw is not None and len(raw) == 16 else None


def decode_link(buf: bytes, offset: int, length: int) -> LinkRow:
    _family, _type, index, flags, _change = IFINFO.unpack_from(buf, offset + HDR.size)
    attrs = parse_attrs(buf, offset + HDR.size + IFINFO.size, offset + length)
    mtu_raw = attrs.get(IFLA_MTU)
    mac_raw = attrs.get(IFLA_ADDRESS)
    master_raw = attrs.get(IFLA_MASTER)
    alias_raw = attrs.get(IFLA_IFALIAS)
    row = LinkRow(
        index=index,
        name=attrs.get(IFLA_IFNAME, b"").rstrip(b"\0").decode(errors="replace"),
        flags=flags,
        mtu=U32.unpack(mtu_raw)[0] if mtu_raw else 0,
        mac=mac_text(mac_raw) if mac_raw and len(mac_raw) == 6 else None,
        master=U32.unpack(master_raw)[0] if master_raw else 0,
        alias=alias_raw.rstrip(b"\0").decode(errors="replace") if alias_raw else None,
    )
    info = attrs.get(IFLA_LINKINFO)
    if info is not None:
        nested = parse_attrs(info, 0, len(info))
        kind = nested.get(IFLA_INFO_KIND)
        row.kind = kind.rstrip(b"\0").decode() if kind else None
        data = nested.get(IFLA_INFO_DATA)
        if row.kind == "vxlan" and data is not None:
            row.vxlan = parse_attrs(data, 0, len(data))
    return row


class LinkStats(NamedTuple):
    """The first eight counters of ``rtnl_link_stats64`` (IFLA_STATS64), in its order."""

    rx_packets: int = 0
    tx_packets: int = 0
    rx_bytes: int = 0
    tx_bytes: int = 0
    rx_errors: int = 0
    tx_errors: int = 0
    rx_dropped: int = 0
    tx_dropped: int = 0


_STATS8 = struct.Struct("=8Q")


class LinkStatsRow(NamedTuple):
    """A link's identity, bridge master (0: none) and counters, from one dump entry."""

    ifindex: int
    name: str
    kind: str | None
    master: int
    flags: int
    stats: LinkStats


def decode_link_stats(buf: bytes, offset: int, length: int) -> LinkStatsRow:
    _family, _type, index, flags, _change = IFINFO.unpack_from(buf, offset + HDR.size)
    # Hot path (one message per link per scrape, ~50 attributes each): scan for the
    # four we need in place instead of building a dict of every attribute.
    name = ""
    kind = None
    master = 0
    stats = None
    pos = offset + HDR.size + IFINFO.size
    end = offset + length
    unpack = ATTR.unpack_from
    while pos + 4 <= end:
        attr_len, attr_type = unpack(buf, pos)
        if attr_len < 4:
            break
        attr_type &= 0x3FFF
        if attr_type == IFLA_IFNAME:
            name = buf[pos + 4 : pos + attr_len].rstrip(b"\0").decode(errors="replace")
        elif attr_type == IFLA_MASTER and attr_len == 8:
            master = U32.unpack_from(buf, pos + 4)[0]
        elif attr_type == IFLA_STATS64 and attr_len >= 4 + _STATS8.size:
            # Older kernels' struct is shorter than today's; the first eight never moved.
            stats = LinkStats(*_STATS8.unpack_from(buf, pos + 4))
        elif attr_type == IFLA_LINKINFO:
            raw = parse_attrs(buf, pos + 4, pos + attr_len).get(IFLA_INFO_KIND)
            kind = raw.rstrip(b"\0").decode() if raw else None
        pos += (attr_len + 3) & ~3
    return LinkStatsRow(index, name, kind, master, flags, stats or LinkStats())


def decode_route(buf: bytes, offset: int, length: int) -> RouteRow | None:
    family, dst_len, _s, _t, table, proto, _scope, rtype, flags = RTMSG.unpack_from(
        buf, offset + HDR.size
    )
    if family == AF_INET6:
        return _decode_route6(buf, offset, length, dst_len, table, proto, rtype, flags)
    if family != AF_INET:
        return None
    dst = gateway = prefsrc = None
    oif = 0
    pos = offset + HDR.size + RTMSG.size
    end = offset + length
    unpack = ATTR.unpack_from
    while pos + 4 <= end:  # hot path: no dict per message (see decode_neigh)
        attr_len, attr_type = unpack(buf, pos)
        if attr_len < 4:
            break
        if attr_len == 8:
            if attr_type == RTA_DST:
                dst = IPv4Address(_BE32.unpack_from(buf, pos + 4)[0])
            elif attr_type == RTA_GATEWAY:
                gateway = IPv4Address(_BE32.unpack_from(buf, pos + 4)[0])
            elif attr_type == RTA_OIF:
                oif = U32.unpack_from(buf, pos + 4)[0]
            elif attr_type == RTA_TABLE:
                table = U32.unpack_from(buf, pos + 4)[0]
            elif attr_type == RTA_PREFSRC:
                prefsrc = IPv4Address(_BE32.unpack_from(buf, pos + 4)[0])
        pos += (attr_len + 3) & ~3
    return RouteRow(
        dst or IPv4Address(0), dst_len, gateway, oif, proto, table, rtype, flags, prefsrc
    )


def _decode_route6(
    buf: bytes,
    offset: int,
    length: int,
    dst_len: int,
    table: int,
    proto: int,
    rtype: int,
    flags: int,
) -> RouteRow:
    attrs = parse_attrs(buf, offset + HDR.size + RTMSG.size, offset + length)
    table_raw = attrs.get(RTA_TABLE)
    oif_raw = attrs.get(RTA_OIF)
    return RouteRow(
        ipv6(attrs.get(RTA_DST)) or IPv6Address(0),
        dst_len,
        ipv6(attrs.get(RTA_GATEWAY)),
        U32.unpack(oif_raw)[0] if oif_raw and len(oif_raw) == 4 else 0,
        proto,
        U32.unpack(table_raw)[0] if table_raw and len(table_raw) == 4 else table,
        rtype,
        flags,
        ipv6(attrs.get(RTA_PREFSRC)),
    )


def decode_neigh(buf: bytes, offset: int, length: int) -> NeighRow:
    family, _p1, _p2, ifindex, state, flags, _type = NDMSG.unpack_from(buf, offset + HDR.size)
    # Hot path (three dumps of thousands of entries): scan the two attributes we
    # need in place instead of building a dict per message.
    dst: IPv4Address | IPv6Address | None = None
    lladdr = None
    pos = offset + HDR.size + NDMSG.size
    end = offset + length
    unpack = ATTR.unpack_from
    while pos + 4 <= end:
        attr_len, attr_type = unpack(buf, pos)
        if attr_len < 4:
            break
        if attr_type == NDA_DST and attr_len == 8:
            dst = IPv4Address(_BE32.unpack_from(buf, pos + 4)[0])
        elif attr_type == NDA_DST and attr_len == 20:
            dst = IPv6Address(buf[pos + 4 : pos + 20])
        elif attr_type == NDA_LLADDR and attr_len == 10:
            lladdr = buf[pos + 4 : pos + 10].hex(":")
        pos += (attr_len + 3) & ~3
    return NeighRow(family, ifindex, state, flags, dst, lladdr)


def decode_addr(buf: bytes, offset: int, length: int) -> AddrRow | None:
    family, prefixlen, flags, _scope, index = IFADDR.unpack_from(buf, offset + HDR.size)
    if family != AF_INET:
        return None
    attrs = parse_attrs(buf, offset + HDR.size + IFADDR.size, offset + length)
    # IFA_LOCAL is the address itself; IFA_ADDRESS is the peer on point-to-point links.
    address = ipv4(attrs.get(IFA_LOCAL)) or ipv4(attrs.get(IFA_ADDRESS))
    if address is None:
        return None
    return AddrRow(index, address, prefixlen, _addr_flags(attrs, flags))


def decode_addr6(buf: bytes, offset: int, length: int) -> AddrRow6 | None:
    family, prefixlen, flags, _scope, index = IFADDR.unpack_from(buf, offset + HDR.size)
    if family != AF_INET6:
        return None
    attrs = parse_attrs(buf, offset + HDR.size + IFADDR.size, offset + length)
    # IPv6 addresses carry IFA_ADDRESS (IFA_LOCAL too on point-to-point links).
    address = ipv6(attrs.get(IFA_LOCAL)) or ipv6(attrs.get(IFA_ADDRESS))
    if address is None:
        return None
    return AddrRow6(index, address, prefixlen, _addr_flags(attrs, flags))


def _addr_flags(attrs: dict[int, bytes], header_flags: int) -> int:
    raw = attrs.get(IFA_FLAGS)
    return U32.unpack(raw)[0] if raw and len(raw) == 4 else header_flags
