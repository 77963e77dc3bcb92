"""The real :class:`~flannelpy.dataplane.kernel.Kernel`: rtnetlink in the caller's namespace.

Split of work:

* links and addresses (a handful per node) go through pyroute2, which knows how
  to encode a vxlan device;
* neighbours, FDB entries and routes (three per peer, thousands on a big
  cluster) and every dump go through :mod:`flannelpy.dataplane.nlbatch`, which
  packs many messages per syscall and decodes only what we need.

Every call opens its own sockets in the calling thread's network namespace and
closes them before returning, so one ``NetlinkKernel`` may be shared by threads,
and a thread that entered a namespace (``netns.run_in_netns``, ``ip netns
exec``) programs that namespace.

Only this module, ``nlbatch`` and ``netns`` may import pyroute2.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import select
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from ipaddress import (
    IPv4Address,
    IPv4Interface,
    IPv4Network,
    IPv6Address,
    IPv6Interface,
    IPv6Network,
    ip_network,
)

from pyroute2 import IPRoute
from pyroute2.netlink.exceptions import NetlinkError

from flannelpy.dataplane import nlbatch as nl
from flannelpy.dataplane import rtnl
from flannelpy.dataplane.adopt import FlannelRouteShape
from flannelpy.dataplane.kernel import ApplyResult, ForeignRoute
from flannelpy.dataplane.state import (
    BLACKHOLE_METRIC,
    ROUTE_PROTOCOL,
    Address,
    Changes,
    FdbEntry,
    Neighbour,
    ObservedState,
    Route,
    UnderlayInterface,
    VxlanLink,
)
from flannelpy.dataplane.underlay import Interface, choose_underlay, choose_underlay_v6
from flannelpy.errors import DataplaneError

log = logging.getLogger(__name__)

WATCH_POLL_SECONDS = 0.5  # how often watch() looks at its stop event
IFA_F_NODAD = 0x02  # linux/if_addr.h
NO_GATEWAY = IPv4Address(0)  # stands in for a route of ours that has no gateway

# Errors that mean "already gone" for each kind of delete.
_GONE_ON_DELETE = {errno.ENOENT, errno.ESRCH, errno.ENODEV, errno.EADDRNOTAVAIL}


# --- pure helpers ---------------------------------------------------------------


def _reason(error: int, message: str = "") -> str:
    name = errno.errorcode.get(error, str(error))
    text = message or os.strerror(error)
    return f"{text} ({name})"


OWN_LINK_PREFIX = "flannel"  # flannel.<VNI> and flannel-v6.<VNI>: the devices we own


def event_kinds(buf: bytes, protocol: int = ROUTE_PROTOCOL) -> list[str]:
    """What a datagram of rtnetlink notifications means to the reconciler (pure).

    Deletions of our kinds of entries, and our vxlan devices appearing, changing or
    going. Route deletions of other protocols, IPv6, ARP-cache churn and other links
    (every pod's veth, the cni0 bridge) are dropped: the reconciler would find nothing to
    do, and on a busy node pod churn would keep it dumping for nothing."""
    kinds: list[str] = []
    for offset, length, msg_type, _flags, _seq in nl.messages(buf):
        kind = _event_kind(buf, offset, length, msg_type, protocol)
        if kind is not None and kind not in kinds:
            kinds.append(kind)
    return kinds


def _event_kind(buf: bytes, offset: int, length: int, msg_type: int, protocol: int) -> str | None:
    if msg_type in (rtnl.RTM_NEWLINK, rtnl.RTM_DELLINK):
        name = rtnl.decode_link(buf, offset, length).name
        return "link" if name.startswith(OWN_LINK_PREFIX) else None
    if msg_type == rtnl.RTM_DELADDR:
        family = buf[offset + rtnl.HDR.size]
        return "address" if family in (rtnl.AF_INET, rtnl.AF_INET6) else None
    if msg_type == rtnl.RTM_DELROUTE:
        row = rtnl.decode_route(buf, offset, length)
        ours = row is not None and row.protocol == protocol and row.table == rtnl.RT_TABLE_MAIN
        return "route" if ours else None
    if msg_type == rtnl.RTM_DELNEIGH:
        row_n = rtnl.decode_neigh(buf, offset, length)
        if row_n.family == rtnl.AF_BRIDGE:
            return "fdb" if row_n.dst is not None else None
        # An administrative delete reports NUD_FAILED whatever the entry was, so
        # only deletions of live dynamic entries (ARP cache expiry) are dropped.
        if row_n.family in (rtnl.AF_INET, rtnl.AF_INET6) and not row_n.state & rtnl.NUD_DYNAMIC:
            return "neighbour"
    return None


def sysctl_path(name: str) -> str:
    """``net.ipv4.ip_forward`` → /proc/sys/net/ipv4/ip_forward. Names holding a device
    with dots (``flannel.1``) must be given with slashes, as sysctl(8) accepts them."""
    return "/proc/sys/" + (name if "/" in name else name.replace(".", "/"))


# --- the adapter ------------------------------------------------------------------


class NetlinkKernel:
    """Kernel adapter for the network namespace of the calling thread.

    Stateless between calls but for ``adopt_routes``: safe to share between threads, and
    callable from a thread that runs an asyncio loop (apply then hops to a helper thread).
    Routes are tagged with ``route_protocol``; MACs are reported in lower case.
    """

    def __init__(
        self, route_protocol: int = ROUTE_PROTOCOL, watch_buffer: int = nl.SOCKET_BUFFER
    ) -> None:
        self.protocol = route_protocol
        self.watch_buffer = watch_buffer  # bytes; small only in tests that provoke ENOBUFS
        self.adopt: FlannelRouteShape | None = None  # observe reports such routes too

    def adopt_routes(self, shape: FlannelRouteShape) -> None:
        self.adopt = shape

    # -- reading

    def _interfaces(self, sock: nl.NetlinkSocket) -> list[Interface]:
        addrs: dict[int, list[IPv4Interface]] = {}
        for row in nl.dump_addresses(sock):
            addrs.setdefault(row.ifindex, []).append(
                IPv4Interface(f"{row.address}/{row.prefixlen}")
            )
        addrs6: dict[int, list[IPv6Interface]] = {}
        for row6 in nl.dump_addresses6(sock):
            addrs6.setdefault(row6.ifindex, []).append(
                IPv6Interface(f"{row6.address}/{row6.prefixlen}")
            )
        return [
            Interface(
                link.name,
                link.index,
                link.mtu,
                tuple(addrs.get(link.index, ())),
                tuple(addrs6.get(link.index, ())),
            )
            for link in sorted(nl.dump_links(sock), key=lambda r: r.index)
        ]

    def find_underlay(
        self,
        ifaces: Iterable[str] = (),
        iface_regexes: Iterable[str] = (),
        can_reach: IPv4Address | None = None,
        public_ip: IPv4Address | None = None,
        ipv6_only: bool = False,
    ) -> UnderlayInterface:
        with nl.NetlinkSocket(strict=True) as sock:
            interfaces = self._interfaces(sock)
            if ipv6_only:
                return choose_underlay_v6(interfaces, tuple(ifaces), tuple(iface_regexes))
            reach_route = None
            if can_reach is not None:
                row = nl.route_get(sock, can_reach)
                src = row.prefsrc if row is not None else None
                src4 = src if isinstance(src, IPv4Address) else None
                reach_route = (row.oif, src4) if row is not None and row.oif else None
            default_oif = next(
                (
                    r.oif
                    for r in nl.dump_routes(sock)
                    if r.dst_len == 0 and r.oif and r.route_type == rtnl.RTN_UNICAST
                ),
                None,
            )
        return choose_underlay(
            interfaces,
            tuple(ifaces),
            tuple(iface_regexes),
            can_reach,
            reach_route,
            default_oif,
            public_ip,
        )

    def survey(self, ignore_devices: Iterable[str]) -> list[ForeignRoute]:
        ignored = set(ignore_devices)
        found: list[ForeignRoute] = []
        with nl.NetlinkSocket(strict=True) as sock:
            names = {link.index: link.name for link in nl.dump_links(sock)}
            for r in nl.dump_routes(sock):
                dev = names.get(r.oif, "")
                if r.protocol == self.protocol or r.dst_len == 0 or (dev and dev in ignored):
                    continue
                net = IPv4Network(f"{r.dst}/{r.dst_len}", strict=False)
                via = f" via {r.gateway}" if r.gateway else ""
                where = f" dev {dev}" if dev else ""
                gw = r.gateway if isinstance(r.gateway, IPv4Address) else None
                found.append(ForeignRoute(net, f"route {net}{via}{where}", r.protocol,
                                          gw or None, dev))  # fmt: skip
            for a in nl.dump_addresses(sock):
                dev = names.get(a.ifindex, str(a.ifindex))
                if dev in ignored:
                    continue
                iface = IPv4Interface(f"{a.address}/{a.prefixlen}")
                found.append(ForeignRoute(iface.network, f"address {iface} on {dev}",
                                          device=dev, is_address=True))  # fmt: skip
        return found

    def observe(self, link_names: Iterable[str], owned_devices: Iterable[str]) -> ObservedState:
        with nl.NetlinkSocket(strict=True) as sock:
            rows = nl.dump_links(sock)
            names = {r.index: r.name for r in rows}
            by_name = {r.name: r for r in rows}
            wanted = [by_name[n] for n in dict.fromkeys(link_names) if n in by_name]
            links = [_vxlan_link(r, names) for r in wanted if r.kind == "vxlan"]
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
            route_rows = nl.dump_routes(sock, protocol=0 if self.adopt else self.protocol)
            route_rows += nl.dump_routes(sock, protocol=self.protocol, family=rtnl.AF_INET6)
            routes = [
                Route(
                    dst=ip_network((int(r.dst), r.dst_len), strict=False)
                    if r.dst.version == 4
                    else IPv6Network((int(r.dst), r.dst_len), strict=False),
                    gateway=r.gateway or (NO_GATEWAY if r.dst.version == 4 else IPv6Address(0)),
                    ifname=names.get(r.oif, ""),
                    onlink=bool(r.flags & rtnl.RTNH_F_ONLINK),
                    protocol=None if r.protocol == self.protocol else r.protocol,
                    blackhole=r.route_type == rtnl.RTN_BLACKHOLE,
                )
                for r in route_rows
                if r.protocol == self.protocol or _adoptable(self.adopt, r, names)
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

    def link_mac(self, name: str) -> str | None:
        with nl.NetlinkSocket() as sock:
            row = nl.get_link(sock, name)
        return row.mac if row is not None else None

    # -- writing

    def apply(self, changes: Changes) -> ApplyResult:
        if _event_loop_running():
            # pyroute2's synchronous API runs its own event loop, which cannot nest
            # in a running one; a helper thread inherits this thread's namespace.
            return _in_helper_thread(self._apply, changes)
        return self._apply(changes)

    def _apply(self, changes: Changes) -> ApplyResult:
        with nl.NetlinkSocket() as sock, _Batch(sock, self.protocol, self.adopt) as run:
            run.links(changes)
            run.addresses("addresses_to_add", changes.addresses_to_add)
            run.addresses("addresses_to_delete", changes.addresses_to_delete)
            # Per peer: neighbour, FDB, then the route, so the kernel never ARPs.
            run.entries("neighbours_to_set", changes.neighbours_to_set)
            run.entries("fdb_to_set", changes.fdb_to_set)
            run.entries("routes_to_set", run.not_foreign(changes.routes_to_set))
            # Old routes go only once the new ones are in (their destinations differ):
            # a peer moving from the Network's route through flannel-wg to its own
            # route through the VTEP, or back, is never without a route in between.
            run.entries("routes_to_delete", changes.routes_to_delete)
            # A peer's stale neighbour and FDB go only once its route points elsewhere
            # (vxlan -> direct): packets routed to a deleted neighbour wait for an ARP
            # that never comes on the VTEP, and are dropped.
            run.entries("neighbours_to_delete", changes.neighbours_to_delete)
            run.entries("fdb_to_delete", changes.fdb_to_delete)
        applied = {k: v for k, v in run.applied.items() if v}
        return ApplyResult(applied=applied, failures=tuple(run.failures))

    def watch(self, on_event: Callable[[str], None], stop: threading.Event) -> None:
        groups = (
            rtnl.RTMGRP_LINK
            | rtnl.RTMGRP_NEIGH
            | rtnl.RTMGRP_IPV4_IFADDR
            | rtnl.RTMGRP_IPV4_ROUTE
            | rtnl.RTMGRP_IPV6_IFADDR
            | rtnl.RTMGRP_IPV6_ROUTE
        )
        with nl.NetlinkSocket(groups=groups, rcvbuf=self.watch_buffer) as sock:
            while not stop.is_set():
                ready, _, _ = select.select([sock], [], [], WATCH_POLL_SECONDS)
                if not ready:
                    continue
                try:
                    buf = sock.recv()
                except OSError as e:
                    if e.errno != errno.ENOBUFS:
                        raise
                    # The kernel dropped notifications: we cannot know what changed.
                    log.warning("netlink event queue overran; asking for a full resync")
                    on_event("resync")
                    continue
                for kind in event_kinds(buf, self.protocol):
                    on_event(kind)

    def set_sysctl(self, name: str, value: str) -> None:
        path = sysctl_path(name)
        try:
            with open(path, "w") as f:
                f.write(value)
        except OSError as e:
            raise DataplaneError(
                f"cannot set sysctl {name} to {value} ({path}): {e.strerror}"
            ) from e


def _adoptable(adopt: FlannelRouteShape | None, r: rtnl.RouteRow, names: dict[int, str]) -> bool:
    """A route another Flannel left, which a replace of ours may take over (IPv4 only)."""
    if adopt is None or not isinstance(r.dst, IPv4Address):
        return False
    if r.gateway is not None and not isinstance(r.gateway, IPv4Address):
        return False
    dst = IPv4Network((int(r.dst), r.dst_len), strict=False)
    return adopt.adoptable(dst, r.gateway or None, names.get(r.oif, ""), r.protocol)


class _Batch:
    """One ``apply`` call: its sockets, the device index, counts and failures."""

    def __init__(
        self, sock: nl.NetlinkSocket, protocol: int, adopt: FlannelRouteShape | None = None
    ) -> None:
        self.sock = sock
        self.protocol = protocol
        self.adopt = adopt
        self.index = {r.name: r.index for r in nl.dump_links(sock)}
        self.applied: Counter[str] = Counter()
        self.failures: list[str] = []
        self._ipr: IPRoute | None = None

    def __enter__(self) -> _Batch:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._ipr is not None:
            self._ipr.close()

    @property
    def ipr(self) -> IPRoute:
        """pyroute2, opened only when links or addresses change (most passes do not)."""
        if self._ipr is None:
            self._ipr = IPRoute()
        return self._ipr

    def links(self, changes: Changes) -> None:
        for name in changes.links_to_delete:
            try:
                if name in self.index:
                    self.ipr.link("del", index=self.index[name])
            except NetlinkError as e:
                if e.code not in _GONE_ON_DELETE:
                    self.failures.append(f"could not delete link {name}: {_reason(e.code)}")
                    continue
            self.applied["links_to_delete"] += 1
        for link in changes.links_to_create:
            _create_vxlan(self.ipr, self.sock, link)  # raises: nothing works without it
            self.applied["links_to_create"] += 1
        for link in changes.links_to_update:
            self._update(link)
        if changes.links_to_delete or changes.links_to_create:
            self.index = {r.name: r.index for r in nl.dump_links(self.sock)}

    def _update(self, link: VxlanLink) -> None:
        row = nl.get_link(self.sock, link.name)
        if row is None:
            self.failures.append(f"could not update link {link.name}: it does not exist")
            return
        mac = link.mac if link.mac and link.mac.lower() != row.mac else None
        try:
            _update_link(self.ipr, row.index, link.mtu, mac)
        except NetlinkError as e:
            self.failures.append(f"could not update link {link.name}: {_reason(e.code)}")
            return
        self.applied["links_to_update"] += 1

    def not_foreign(self, routes: Sequence[Route]) -> list[Route]:
        """``routes`` without those whose destination holds a route of another protocol:
        NLM_F_REPLACE would overwrite it, and a connected or static route is never ours
        to take (a peer lease naming the underlay's subnet would cut the node off)."""
        if not routes:
            return []
        names = {index: name for name, index in self.index.items()}
        rows = nl.dump_routes(self.sock)
        if any(route.dst.version == 6 for route in routes):
            rows += nl.dump_routes(self.sock, family=rtnl.AF_INET6)
        foreign = {
            (r.dst.version, int(r.dst), r.dst_len): r.protocol
            for r in rows
            if r.protocol != self.protocol and not _adoptable(self.adopt, r, names)
        }
        kept = []
        for route in routes:
            if route.blackhole:  # its own metric: added beside a connected route, never over it
                kept.append(route)
                continue
            proto = foreign.get(
                (route.dst.version, int(route.dst.network_address), route.dst.prefixlen)
            )
            if proto is None:
                kept.append(route)
                continue
            self.failures.append(
                f"refused to set {_describe(route)}: the node has a route to {route.dst} of "
                f"protocol {proto}, not the agent's; remove it or the lease that asks for it"
            )
        return kept

    def addresses(self, key: str, entries: Sequence[Address]) -> None:
        delete = key == "addresses_to_delete"
        verb = "delete" if delete else "add"
        for a in entries:
            if a.ifname not in self.index:
                if delete:  # the device is gone, and its addresses with it
                    self.applied[key] += 1
                else:
                    self.failures.append(
                        f"could not add address {a.address} on {a.ifname}: no such device"
                    )
                continue
            try:
                # IPv6 (flannel-v6.<VNI>): no duplicate address detection, which would
                # leave the VTEP address tentative (unusable) for a second or more; the
                # address is the node's own lease's, unique by construction.
                nodad = {"flags": IFA_F_NODAD} if a.address.version == 6 else {}
                self.ipr.addr(
                    "del" if delete else "replace",
                    index=self.index[a.ifname],
                    address=str(a.address.ip),
                    prefixlen=a.address.network.prefixlen,
                    **nodad,
                )
            except NetlinkError as e:
                if not (delete and e.code in _GONE_ON_DELETE):
                    self.failures.append(
                        f"could not {verb} address {a.address} on {a.ifname}: {_reason(e.code)}"
                    )
                    continue
            self.applied[key] += 1

    def entries(
        self, key: str, entries: Sequence[Route] | Sequence[Neighbour] | Sequence[FdbEntry]
    ) -> None:
        """One kind of bulk write over the fast path; per-entry failures collected."""
        if not entries:
            return
        delete = key.endswith("_to_delete")
        verb = "delete" if delete else "set"
        requests: list[rtnl.Request] = []
        sent: list[Route | Neighbour | FdbEntry] = []
        for entry in entries:
            ifindex = self.index.get(entry.ifname)
            # Our routes are deleted by destination alone, whatever their device.
            if ifindex is None and not (isinstance(entry, Route) and (delete or entry.blackhole)):
                if delete:  # the device is gone, and its entries with it
                    self.applied[key] += 1
                else:
                    self.failures.append(
                        f"could not set {_describe(entry)}: {entry.ifname} does not exist"
                    )
                continue
            # A taken-over route is deleted with its own protocol (the kernel matches it).
            protocol = entry.protocol if isinstance(entry, Route) and entry.protocol else None
            requests.append(_request(entry, delete, ifindex or 0, protocol or self.protocol))
            sent.append(entry)
        try:
            replies = self.sock.batch(requests)
        except OSError as e:
            self.failures.append(f"could not {verb} {len(sent)} {key.split('_')[0]}: {e}")
            return
        for entry, reply in zip(sent, replies, strict=True):
            if reply.error == 0 or (delete and reply.error in _GONE_ON_DELETE):
                self.applied[key] += 1
            else:
                why = _reason(reply.error, reply.message)
                self.failures.append(f"could not {verb} {_describe(entry)}: {why}")


# --- helpers for the adapter ----------------------------------------------------


def _event_loop_running() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def _in_helper_thread(fn: Callable[[Changes], ApplyResult], arg: Changes) -> ApplyResult:
    """Run ``fn(arg)`` in a new thread (same network namespace) and wait for it."""
    result: list[ApplyResult] = []
    error: list[BaseException] = []

    def target() -> None:
        try:
            result.append(fn(arg))
        except BaseException as e:  # re-raised in the caller's thread
            error.append(e)

    thread = threading.Thread(target=target, name="netlink-apply")
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]


def _vxlan_link(row: rtnl.LinkRow, names: dict[int, str]) -> VxlanLink:
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


def _request(
    entry: Route | Neighbour | FdbEntry, delete: bool, ifindex: int, protocol: int
) -> rtnl.Request:
    if isinstance(entry, Route):
        return rtnl.route_request(
            delete,
            protocol,
            entry.dst.network_address.packed,
            entry.dst.prefixlen,
            gateway=entry.gateway if int(entry.gateway) != 0 else None,
            oif=ifindex,
            onlink=entry.onlink,
            blackhole_metric=BLACKHOLE_METRIC if entry.blackhole else None,
        )
    if isinstance(entry, Neighbour):
        return rtnl.neigh_request(delete, ifindex, entry.ip, entry.mac)
    return rtnl.fdb_request(delete, ifindex, entry.mac, entry.dst)


def _describe(entry: Route | Neighbour | FdbEntry) -> str:
    if isinstance(entry, Route):
        if entry.blackhole:
            return f"route blackhole {entry.dst} metric {BLACKHOLE_METRIC}"
        onlink = " onlink" if entry.onlink else ""
        return f"route {entry.dst} via {entry.gateway} dev {entry.ifname}{onlink}"
    if isinstance(entry, Neighbour):
        return f"neighbour {entry.ip} lladdr {entry.mac} dev {entry.ifname}"
    return f"fdb {entry.mac} dst {entry.dst} dev {entry.ifname}"


def _vxlan_matches(row: rtnl.LinkRow, link: VxlanLink, names: dict[int, str]) -> bool:
    """True when an existing device can be kept: its immutable vxlan attributes match."""
    if row.kind != "vxlan":
        return False
    have = _vxlan_link(row, names)
    return (have.vni, have.local_ip, have.underlay, have.port, have.gbp, have.learning) == (
        link.vni,
        link.local_ip,
        link.underlay,
        link.port,
        link.gbp,
        link.learning,
    )


def _create_vxlan(ipr: IPRoute, sock: nl.NetlinkSocket, link: VxlanLink) -> None:
    """Create (or adopt a matching) vxlan device and bring it up; DataplaneError if impossible."""
    rows = nl.dump_links(sock)
    names = {r.index: r.name for r in rows}
    by_name = {r.name: r for r in rows}
    underlay = by_name.get(link.underlay)
    if underlay is None:
        raise DataplaneError(
            f"cannot create {link.name}: the underlay interface {link.underlay} does not exist"
        )
    existing = by_name.get(link.name)
    try:
        if existing is not None and _vxlan_matches(existing, link, names):
            mac = link.mac if link.mac and link.mac != existing.mac else None
            _update_link(ipr, existing.index, link.mtu, mac)
            return
        if existing is not None:
            ipr.link("del", index=existing.index)
        spec: dict[str, object] = {
            "ifname": link.name,
            "kind": "vxlan",
            "vxlan_id": link.vni,
            # flannel-v6.<VNI>: an IPv6 underlay (VXLAN over IPv6 costs 70 bytes, not 50).
            ("vxlan_local6" if link.local_ip.version == 6 else "vxlan_local"): str(link.local_ip),
            "vxlan_link": underlay.index,
            "vxlan_port": link.port,
            "vxlan_learning": int(link.learning),
            "mtu": link.mtu,
        }
        if link.gbp:
            spec["vxlan_gbp"] = True
        if link.mac:
            spec["address"] = link.mac
        ipr.link("add", **spec)
        created = nl.get_link(sock, link.name)
        if created is None:
            raise DataplaneError(f"cannot create {link.name}: it vanished right after creation")
        ipr.link("set", index=created.index, state="up")
    except NetlinkError as e:
        raise DataplaneError(
            f"cannot create vxlan device {link.name} (VNI {link.vni}, local {link.local_ip},"
            f" dev {link.underlay}, port {link.port}): {_reason(e.code)}"
        ) from e


def _update_link(ipr: IPRoute, index: int, mtu: int, mac: str | None) -> None:
    """Set MTU (and MAC) in place and bring the link up."""
    ipr.link("set", index=index, mtu=mtu)
    if mac is not None:
        try:
            ipr.link("set", index=index, address=mac)
        except NetlinkError as e:
            if e.code != errno.EBUSY:
                raise
            # Some drivers refuse a MAC change while up.
            ipr.link("set", index=index, state="down")
            ipr.link("set", index=index, address=mac)
    ipr.link("set", index=index, state="up")
