"""Writing :class:`~flannelpy.dataplane.state.Changes` to the kernel, in their order.

Everything goes through :mod:`flannelpy.dataplane.nlbatch`: links and addresses (a
handful per node) one request at a time (the VTEP's from :mod:`.rtnl_vxlan`),
neighbours, FDB entries and routes (three per peer) many messages per syscall. Per-entry
failures are
collected, never raised mid-batch; a vxlan device that cannot be created raises, as
nothing works without it.
"""

from __future__ import annotations

import errno
import os
import socket
from collections import Counter
from collections.abc import Sequence
from ipaddress import IPv6Address, IPv6Network

from flannelpy.dataplane import nlbatch as nl
from flannelpy.dataplane import rtnl
from flannelpy.dataplane.adopt import FlannelRouteShape
from flannelpy.dataplane.kernel import ApplyResult
from flannelpy.dataplane.netlink_events import (
    DeletionKey,
    OwnDeletions,
    fdb_key,
    neighbour_key,
    route_key,
)
from flannelpy.dataplane.netlink_observe import adoptable, vxlan_link
from flannelpy.dataplane.rtnl_vxlan import link_mac_request, vxlan_request
from flannelpy.dataplane.state import (
    BLACKHOLE_METRIC,
    Address,
    Changes,
    FdbEntry,
    Neighbour,
    Route,
    VxlanLink,
)
from flannelpy.errors import DataplaneError

# At most this many routes to set are checked for a foreign route one lookup each; more
# (a start, a burst of leases) are checked against one dump of the table.
LOOKUPS_AT_MOST = 8
# Errors that mean "already gone" for each kind of delete.
_GONE_ON_DELETE = {errno.ENOENT, errno.ESRCH, errno.ENODEV, errno.EADDRNOTAVAIL}


def apply(
    changes: Changes,
    protocol: int,
    adopt: FlannelRouteShape | None,
    own: OwnDeletions | None = None,
) -> ApplyResult:
    """:meth:`~flannelpy.dataplane.kernel.Kernel.apply`: routes are written with
    ``protocol``; those ``adopt`` matches are taken over, never refused as foreign. The
    deletions of routes, neighbours and FDB entries are told to ``own`` first, for the
    watch to recognise their notifications."""
    with nl.NetlinkSocket() as sock:
        run = _Batch(sock, protocol, adopt, own)
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


def _reason(error: int, message: str = "") -> str:
    name = errno.errorcode.get(error, str(error))
    text = message or os.strerror(error)
    return f"{text} ({name})"


class LinkIndex:
    """Device name -> ifindex, asked of the kernel per name on first use (one ioctl)
    rather than a dump of every link per call: a node's links are mostly its pods'
    veths, and an apply names one or two devices. Built anew after links change."""

    def __init__(self) -> None:
        self._known: dict[str, int | None] = {}

    def get(self, name: str) -> int | None:
        if name not in self._known:
            try:
                self._known[name] = socket.if_nametoindex(name)
            except OSError:  # no such device (ENODEV), or a name the kernel cannot hold
                self._known[name] = None
        return self._known[name]

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self.get(name) is not None

    def __getitem__(self, name: str) -> int:
        index = self.get(name)
        if index is None:
            raise KeyError(name)
        return index


class _Batch:
    """One ``apply`` call: its sockets, the device index, counts and failures."""

    def __init__(
        self,
        sock: nl.NetlinkSocket,
        protocol: int,
        adopt: FlannelRouteShape | None = None,
        own: OwnDeletions | None = None,
    ) -> None:
        self.sock = sock
        self.protocol = protocol
        self.adopt = adopt
        self.own = own
        self.index = LinkIndex()
        self.applied: Counter[str] = Counter()
        self.failures: list[str] = []

    def links(self, changes: Changes) -> None:
        for name in changes.links_to_delete:
            try:
                if name in self.index:
                    _call(self.sock, rtnl.link_delete_index_request(self.index[name]))
            except nl.KernelRefused as e:
                if e.errno not in _GONE_ON_DELETE:
                    self.failures.append(f"could not delete link {name}: {_refusal(e)}")
                    continue
            self.applied["links_to_delete"] += 1
        for link in changes.links_to_create:
            _create_vxlan(self.sock, link)  # raises: nothing works without it
            self.applied["links_to_create"] += 1
        for link in changes.links_to_update:
            self._update(link)
        if changes.links_to_delete or changes.links_to_create:
            self.index = LinkIndex()

    def _update(self, link: VxlanLink) -> None:
        row = nl.get_link(self.sock, link.name)
        if row is None:
            self.failures.append(f"could not update link {link.name}: it does not exist")
            return
        mac = link.mac if link.mac and link.mac.lower() != row.mac else None
        try:
            _update_link(self.sock, row.index, link.mtu, mac)
        except nl.KernelRefused as e:
            self.failures.append(f"could not update link {link.name}: {_refusal(e)}")
            return
        self.applied["links_to_update"] += 1

    def not_foreign(self, routes: Sequence[Route]) -> list[Route]:
        """``routes`` without those whose destination holds a route of another protocol:
        NLM_F_REPLACE would overwrite it, and a connected or static route is never ours
        to take (a peer lease naming the underlay's subnet would cut the node off)."""
        if not routes:
            return []
        foreign = self._foreign_by_lookup(routes)
        if foreign is None:
            rows = nl.dump_routes(self.sock)
            if any(route.dst.version == 6 for route in routes):
                rows += nl.dump_routes(self.sock, family=rtnl.AF_INET6)
            foreign = self._foreign(rows)
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

    def _foreign(self, rows: Sequence[rtnl.RouteRow]) -> dict[tuple[int, int, int], int]:
        """(IP version, destination, prefix length) -> protocol of the routes in ``rows``
        that are not ours and not another Flannel's to take over."""
        others = [r for r in rows if r.protocol != self.protocol]
        # Device names only to judge another Flannel's routes, which name theirs.
        names = {r.index: r.name for r in nl.dump_links(self.sock)} if self.adopt and others else {}
        return {
            (r.dst.version, int(r.dst), r.dst_len): r.protocol
            for r in others
            if not adoptable(self.adopt, r, names)
        }

    def _foreign_by_lookup(self, routes: Sequence[Route]) -> dict[tuple[int, int, int], int] | None:
        """:meth:`_foreign` for a few IPv4 routes, one route lookup each instead of a dump
        of the table (a peer's new route, among thousands, cost a dump of all of them).
        The lookup of a destination's first address finds the longest match in the main
        table: a route of that very destination, if there is one, or a shorter one (the
        default route) if there is none, or no route at all (a node without a default
        route; only a ``throw`` route there, which sends lookups on, would go unseen).
        None, for the dump to decide, when a lookup cannot tell: an error route, a longer
        match hiding the destination, or an answer from another table (policy routing)."""
        if len(routes) > LOOKUPS_AT_MOST or any(r.dst.version != 4 for r in routes):
            return None
        found: list[rtnl.RouteRow] = []
        for route in routes:
            if route.blackhole:
                continue  # kept whatever is there (not_foreign)
            row = nl.fib_match(self.sock, route.dst.network_address)  # type: ignore[arg-type]
            if row == errno.ENETUNREACH:
                continue  # no route matches the destination's address: none is there
            if (
                isinstance(row, int)
                or row.table != rtnl.RT_TABLE_MAIN
                or row.dst_len > route.dst.prefixlen
            ):
                return None
            if row.dst_len == route.dst.prefixlen:
                found.append(row)
        return self._foreign(found)

    def addresses(self, key: str, entries: Sequence[Address]) -> None:
        delete = key == "addresses_to_delete"
        verb = "delete" if delete else "add"
        for a in entries:
            if a.ifname not in self.index:
                why = f"could not add address {a.address} on {a.ifname}: no such device"
                self._no_device(key, delete, why)
                continue
            try:
                # IPv6 (flannel-v6.<VNI>): no duplicate address detection (IFA_F_NODAD),
                # which would leave the VTEP address tentative (unusable) for a second or
                # more; the address is the node's own lease's, unique by construction.
                _call(self.sock, rtnl.address_request(self.index[a.ifname], a.address, delete))
            except nl.KernelRefused as e:
                if not (delete and e.errno in _GONE_ON_DELETE):
                    self.failures.append(
                        f"could not {verb} address {a.address} on {a.ifname}: {_refusal(e)}"
                    )
                    continue
            self.applied[key] += 1

    def _no_device(self, key: str, delete: bool, failure: str) -> None:
        """An entry on a device that does not exist: on delete, gone with the device."""
        if delete:
            self.applied[key] += 1
        else:
            self.failures.append(failure)

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
        indexes: list[int] = []
        for entry in entries:
            ifindex = self.index.get(entry.ifname)
            # Our routes are deleted by destination alone, whatever their device.
            if ifindex is None and not (isinstance(entry, Route) and (delete or entry.blackhole)):
                why = f"could not set {_describe(entry)}: {entry.ifname} does not exist"
                self._no_device(key, delete, why)
                continue
            # A taken-over route is deleted with its own protocol (the kernel matches it).
            protocol = entry.protocol if isinstance(entry, Route) and entry.protocol else None
            requests.append(_request(entry, delete, ifindex or 0, protocol or self.protocol))
            sent.append(entry)
            indexes.append(ifindex or 0)
        own = self.own if delete else None
        keys = [_deletion_key(entry, ifindex) for entry, ifindex in zip(sent, indexes, strict=True)]
        if own is not None:
            own.expect(keys)
        try:
            replies = self.sock.batch(requests)
        except OSError as e:
            if own is not None:
                own.forget(keys)
            self.failures.append(f"could not {verb} {len(sent)} {key.split('_')[0]}: {e}")
            return
        if own is not None:  # no notification follows a refused or needless deletion
            own.forget(k for k, reply in zip(keys, replies, strict=True) if reply.error != 0)
        refused: list[Route] = []
        for entry, reply in zip(sent, replies, strict=True):
            if reply.error == 0 or (delete and reply.error in _GONE_ON_DELETE):
                self.applied[key] += 1
            elif not delete and isinstance(entry, Route) and _gateway_elsewhere(entry, reply.error):
                refused.append(entry)
            else:
                why = _reason(reply.error, reply.message)
                self.failures.append(f"could not {verb} {_describe(entry)}: {why}")
        if refused:
            self._onlink_via_gateway_route(key, refused)

    def _onlink_via_gateway_route(self, key: str, routes: Sequence[Route]) -> None:
        """Set IPv6 onlink ``routes`` the kernel refused because each one's gateway is
        routed through another device: a pair moving from a direct path (``S6 via
        PublicIPv6 dev eth0``) or from flannel-wg-v6's route for the IPv6Network to its
        VTEP. The kernel checks an IPv6 onlink gateway against the routing table (IPv4
        does not); a route for the gateway alone through the VTEP, put first and removed
        after, lets the new route in while the old one still carries the traffic."""
        bridges = [Route(IPv6Network(f"{r.gateway}/128"), IPv6Address(0), r.ifname) for r in routes]
        requests = []
        for bridge, route in zip(bridges, routes, strict=True):
            ifindex = self.index[route.ifname]
            requests += [
                _request(bridge, False, ifindex, self.protocol),
                _request(route, False, ifindex, self.protocol),
            ]
        try:
            replies = self.sock.batch(requests)
            self.sock.batch([_request(b, True, 0, self.protocol) for b in bridges])
        except OSError as e:
            self.failures.append(f"could not set {len(routes)} routes: {e}")
            return
        for route, reply in zip(routes, replies[1::2], strict=True):
            if reply.error == 0:
                self.applied[key] += 1
            else:
                why = _reason(reply.error, reply.message)
                self.failures.append(f"could not set {_describe(route)}: {why}")


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


def _deletion_key(entry: Route | Neighbour | FdbEntry, ifindex: int) -> DeletionKey:
    """The entry as its deletion's notification will name it."""
    if isinstance(entry, Route):
        dst = entry.dst
        return route_key(dst.version, int(dst.network_address), dst.prefixlen)
    if isinstance(entry, Neighbour):
        return neighbour_key(ifindex, entry.ip)
    return fdb_key(ifindex, entry.mac, entry.dst)


def _gateway_elsewhere(route: Route, error: int) -> bool:
    """The kernel's refusal of an IPv6 onlink route whose gateway is routed through
    another device ("Nexthop has invalid gateway or device mismatch")."""
    return route.onlink and route.dst.version == 6 and error == errno.EINVAL


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
    have = vxlan_link(row, names)
    return (have.vni, have.local_ip, have.underlay, have.port, have.gbp, have.learning) == (
        link.vni,
        link.local_ip,
        link.underlay,
        link.port,
        link.gbp,
        link.learning,
    )


def _call(sock: nl.NetlinkSocket, request: rtnl.Request) -> None:
    """Send one request and wait for its answer; KernelRefused on an error."""
    reply, _ = sock.request(request)
    if reply.error:
        raise nl.KernelRefused(reply)


def _refusal(e: nl.KernelRefused) -> str:
    return _reason(e.reply.error, e.reply.message)


def _create_vxlan(sock: nl.NetlinkSocket, link: VxlanLink) -> None:
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
            _update_link(sock, existing.index, link.mtu, mac)
            return
        if existing is not None:
            _call(sock, rtnl.link_delete_index_request(existing.index))
        # flannel-v6.<VNI>: an IPv6 underlay (VXLAN over IPv6 costs 70 bytes, not 50).
        _call(sock, vxlan_request(link, underlay.index))
        created = nl.get_link(sock, link.name)
        if created is None:
            raise DataplaneError(f"cannot create {link.name}: it vanished right after creation")
        _call(sock, rtnl.link_set_request(created.index, up=True))
    except nl.KernelRefused as e:
        raise DataplaneError(
            f"cannot create vxlan device {link.name} (VNI {link.vni}, local {link.local_ip},"
            f" dev {link.underlay}, port {link.port}): {_refusal(e)}"
        ) from e


def _update_link(sock: nl.NetlinkSocket, index: int, mtu: int, mac: str | None) -> None:
    """Set MTU (and MAC) in place and bring the link up."""
    _call(sock, rtnl.link_set_request(index, mtu=mtu))
    if mac is not None:
        try:
            _call(sock, link_mac_request(index, mac))
        except nl.KernelRefused as e:
            if e.errno != errno.EBUSY:
                raise
            # Some drivers refuse a MAC change while up.
            _call(sock, rtnl.link_set_request(index, up=False))
            _call(sock, link_mac_request(index, mac))
    _call(sock, rtnl.link_set_request(index, up=True))
