"""The kernel's rtnetlink notifications, read for the reconciler: which of them mean a
pass is due (:func:`event_kinds`, pure) and the loop that listens for them (:func:`watch`).
"""

from __future__ import annotations

import errno
import logging
import select
import threading
import time
from collections.abc import Callable, Iterable
from ipaddress import IPv4Address, IPv6Address

from flannelpy.dataplane import nlbatch as nl
from flannelpy.dataplane import nlfilter, rtnl
from flannelpy.dataplane.state import ROUTE_PROTOCOL

# The adapter's logger: these lines are the kernel adapter's, as before the split.
log = logging.getLogger("flannelpy.dataplane.netlink")

WATCH_POLL_SECONDS = 0.5  # how often watch() looks at its stop event
OWN_LINK_PREFIX = "flannel"  # flannel.<VNI> and flannel-v6.<VNI>: the devices we own
RTPROT_KERNEL = 2  # the kernel's own routes (an address's subnet, fe80::/64 of a link)

# How long a deletion of ours waits for its notification: the kernel sends it as the
# request is done, and the watch reads it within milliseconds.
ECHO_SECONDS = 2.0

# What a deleted entry is, as a request of ours names it and as its notification does:
# its kind first, then what identifies it.
ROUTE_KEY, NEIGHBOUR_KEY, FDB_KEY = 1, 2, 3
DeletionKey = (
    tuple[int, int, int, int]  # (ROUTE_KEY, IP version, destination, prefix length)
    | tuple[int, int, IPv4Address | IPv6Address]  # (NEIGHBOUR_KEY, ifindex, IP)
    | tuple[int, int, str, IPv4Address | IPv6Address]  # (FDB_KEY, ifindex, MAC, VTEP address)
)


def route_key(version: int, dst: int, prefixlen: int) -> DeletionKey:
    return (ROUTE_KEY, version, dst, prefixlen)


def neighbour_key(ifindex: int, ip: IPv4Address | IPv6Address) -> DeletionKey:
    return (NEIGHBOUR_KEY, ifindex, ip)


def fdb_key(ifindex: int, mac: str, dst: IPv4Address | IPv6Address) -> DeletionKey:
    return (FDB_KEY, ifindex, mac.lower(), dst)


class OwnDeletions:
    """The deletions this process has just asked of the kernel, so that the watch can
    tell their notifications from someone else's: a peer lease that goes deletes its
    route, neighbour and FDB entry, and each deletion's notification would otherwise
    call for a pass that reads the whole kernel to find nothing (a node's every lease
    deletion cost two passes). Each is expected once, for :data:`ECHO_SECONDS`; a
    deletion someone else makes is never expected, so it still wakes the reconciler.
    Thread-safe: the apply's thread expects, the watch's consumes."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._expected: dict[DeletionKey, float] = {}  # key -> until when

    def expect(self, keys: Iterable[DeletionKey]) -> None:
        now = self._clock()
        with self._lock:
            if self._expected:  # those whose notification never came (refused, gone)
                self._expected = {k: t for k, t in self._expected.items() if t >= now}
            for key in keys:
                self._expected[key] = now + ECHO_SECONDS

    def forget(self, keys: Iterable[DeletionKey]) -> None:
        """Deletions the kernel refused or found done already: no notification follows."""
        with self._lock:
            for key in keys:
                self._expected.pop(key, None)

    def consume(self, key: DeletionKey) -> bool:
        """True once for a notification of an expected deletion (then no longer expected)."""
        with self._lock:
            until = self._expected.pop(key, None)
        return until is not None and until >= self._clock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._expected)


def _never(_key: DeletionKey) -> bool:
    return False


_GROUPS = (
    rtnl.RTMGRP_LINK
    | rtnl.RTMGRP_NEIGH
    | rtnl.RTMGRP_IPV4_IFADDR
    | rtnl.RTMGRP_IPV4_ROUTE
    | rtnl.RTMGRP_IPV6_IFADDR
    | rtnl.RTMGRP_IPV6_ROUTE
)


def event_kinds(
    buf: bytes, protocol: int = ROUTE_PROTOCOL, own: Callable[[DeletionKey], bool] = _never
) -> list[str]:
    """What a datagram of rtnetlink notifications means to the reconciler (pure).

    Deletions of our kinds of entries, our vxlan devices appearing, changing or going,
    and a route of another tool appearing in the main table (``ip route replace`` over
    one of ours reports only the new route, of its own protocol). Route deletions of
    other protocols, the kernel's own routes, ARP-cache churn and other links (every
    pod's veth, the cni0 bridge) are dropped: the reconciler would find nothing to do,
    and on a busy node pod churn would keep it dumping for nothing. So are what a veth
    takes with it when a pod goes: its IPv6 link-local address (the reconciler's
    addresses are all of global scope) and its multicast neighbours (ff02::16 and the
    like; the reconciler's neighbours are peers' VTEP addresses, never multicast); before
    these two were dropped, every CNI DEL cost a full reconcile pass. What no
    notification tells apart from our own writes (a neighbour or FDB entry rewritten in
    place) is left to the periodic resync. A deletion ``own`` recognises (one of ours,
    :class:`OwnDeletions`) is dropped too."""
    kinds: list[str] = []
    for offset, length, msg_type, _flags, _seq in nl.messages(buf):
        kind = _event_kind(buf, offset, length, msg_type, protocol, own)
        if kind is not None and kind not in kinds:
            kinds.append(kind)
    return kinds


def _event_kind(
    buf: bytes,
    offset: int,
    length: int,
    msg_type: int,
    protocol: int,
    own: Callable[[DeletionKey], bool],
) -> str | None:
    if msg_type in (rtnl.RTM_NEWLINK, rtnl.RTM_DELLINK):
        # The scrape's in-place scan, not decode_link's dict of ~40 attributes: a pod brings
        # about 20 link notifications, and only the name matters here.
        name = rtnl.decode_link_stats(buf, offset, length).name
        return "link" if name.startswith(OWN_LINK_PREFIX) else None
    if msg_type == rtnl.RTM_DELADDR:
        family, _prefixlen, _flags, scope, _index = rtnl.IFADDR.unpack_from(
            buf, offset + rtnl.HDR.size
        )
        ours = family in (rtnl.AF_INET, rtnl.AF_INET6) and scope != rtnl.RT_SCOPE_LINK
        return "address" if ours else None
    if msg_type in (rtnl.RTM_DELROUTE, rtnl.RTM_NEWROUTE):
        row = rtnl.decode_route(buf, offset, length)
        if row is None or row.table != rtnl.RT_TABLE_MAIN:
            return None
        if msg_type == rtnl.RTM_DELROUTE:
            if row.protocol != protocol:
                return None
            return None if own(route_key(row.dst.version, int(row.dst), row.dst_len)) else "route"
        return "route" if row.protocol not in (protocol, RTPROT_KERNEL) else None
    if msg_type == rtnl.RTM_DELNEIGH:
        row_n = rtnl.decode_neigh(buf, offset, length)
        if row_n.family == rtnl.AF_BRIDGE:
            if row_n.dst is None:
                return None
            mine = row_n.lladdr is not None and own(fdb_key(row_n.ifindex, row_n.lladdr, row_n.dst))
            return None if mine else "fdb"
        # An administrative delete reports NUD_FAILED whatever the entry was, so
        # only deletions of live dynamic entries (ARP cache expiry) are dropped.
        if row_n.dst is not None and row_n.dst.is_multicast:
            return None
        if row_n.family in (rtnl.AF_INET, rtnl.AF_INET6) and not row_n.state & rtnl.NUD_DYNAMIC:
            mine = row_n.dst is not None and own(neighbour_key(row_n.ifindex, row_n.dst))
            return None if mine else "neighbour"
    return None


def watch(
    on_event: Callable[[str], None],
    stop: threading.Event,
    protocol: int,
    buffer: int,
    own: Callable[[DeletionKey], bool] = _never,
) -> None:
    """Call ``on_event`` with each kind of event until ``stop`` is set; "resync" when
    the kernel dropped notifications. ``buffer`` is the socket's receive buffer, bytes;
    ``own`` recognises our own deletions (:class:`OwnDeletions`)."""
    with nl.NetlinkSocket(groups=_GROUPS, rcvbuf=buffer) as sock:
        try:  # the kernel drops what event_kinds would (every pod's links) before queueing
            nlfilter.attach(sock.sock, nlfilter.watch_program(protocol))
        except OSError as e:
            log.warning("netlink watch filter refused, reading every notification error=%s", e)
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
            for kind in event_kinds(buf, protocol, own):
                on_event(kind)
