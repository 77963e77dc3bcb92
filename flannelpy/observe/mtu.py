"""MTU consistency between this node and its peers (pure).

Every flannelpy node advertises its overlay MTU with its lease (the
``"Flannelpy": {"MTU": ...}`` extension). Two nodes with different overlay MTUs
exchange packets that fit one side and not the other, and the larger ones are
dropped without an error (field notes §1). flanneld does not advertise an MTU,
so its leases are "unknown": never reported as a mismatch, only listed, and the
prober's DF probe is what verifies those paths.
"""

from __future__ import annotations

import operator
from bisect import bisect_left, bisect_right
from collections.abc import Iterable
from dataclasses import dataclass, field
from ipaddress import IPv4Address, IPv4Network, IPv6Address, IPv6Network
from typing import NamedTuple

from flannelpy.subnet.lease import Lease
from flannelpy.subnet.memo import Delta, LeaseMemo


class PeerMtu(NamedTuple):
    """One peer lease's MTU advertisement (``advertised`` is None when it has none)."""

    subnet: IPv4Network | IPv6Network
    public_ip: IPv4Address | IPv6Address
    advertised: int | None


@dataclass(frozen=True)
class MtuReport:
    """Peers whose advertised overlay MTU differs from ours, and peers that advertise none."""

    own_mtu: int
    mismatched: list[PeerMtu] = field(default_factory=list)
    unknown: list[PeerMtu] = field(default_factory=list)

    @property
    def consistent(self) -> bool:
        """No peer advertises an MTU different from ours (unknown peers do not count)."""
        return not self.mismatched

    def sentences(self) -> list[str]:
        """One sentence per mismatched, then per unknown peer, for logs and ``doctor``."""
        return [describe_mismatch(self.own_mtu, p) for p in self.mismatched] + [
            describe_unknown(p) for p in self.unknown
        ]


def mtu_mismatches(own_mtu: int, peers: Iterable[Lease]) -> MtuReport:
    """Compare our overlay MTU with what each peer lease advertises.

    Output is sorted by subnet so logs and metrics are stable between runs."""
    return _report(own_mtu, [peer_mtu(lease) for lease in peers])


class MtuChange(NamedTuple):
    """:func:`follow_mtu`'s answer: the report, and the peers that came to advertise no
    MTU and stopped doing so since the memo's last call (by subnet)."""

    report: MtuReport
    unknown_arrived: list[PeerMtu]
    unknown_left: list[PeerMtu]


def follow_mtu(
    own_mtu: int,
    peers: Iterable[Lease],
    memo: LeaseMemo[PeerOrder | None],
    last: MtuReport | None,
    tally: MtuTally | None = None,
) -> MtuChange:
    """:func:`mtu_mismatches` for the writer's plans, which change a lease or two of
    thousands: ``memo`` keeps each lease's advertisement, ``last`` (the report of the
    memo's last call) stands while no lease changed and our MTU is the same, and what
    changed among the peers without an MTU comes from the leases that changed, not from
    comparing every peer's entry. ``tally`` (kept with ``memo``, given to every call or
    to none) holds the report's two sorted lists between calls, changed in place by
    those leases too: without it, a change walks and sorts every peer."""
    delta = memo.update(None, peers, peer_mtu)
    if last is not None and not delta.added and not delta.dropped and last.own_mtu == own_mtu:
        return MtuChange(last, [], [])
    report = _report(own_mtu, delta.results) if tally is None else tally.follow(own_mtu, delta)
    return MtuChange(report, _unknown(delta.added), _unknown(delta.dropped))


Sorted = tuple[list[tuple[int, int, int, int]], list[PeerMtu]]  # sort keys, entries


class MtuTally:
    """The mismatched and the unknown peers of the last report, each as two lists in
    report order (sort keys, entries), changed by the advertisements that came and went:
    a binary search and a move of pointers each, in C."""

    def __init__(self) -> None:
        self._own_mtu: int | None = None
        self._mismatched: Sorted = ([], [])
        self._unknown: Sorted = ([], [])

    def follow(self, own_mtu: int, delta: Delta[PeerOrder | None]) -> MtuReport:
        """The report after ``delta`` (the memo's answer for the same leases)."""
        if own_mtu != self._own_mtu or not all(map(self._remove, delta.dropped)):
            # Every peer judged again: our MTU changed, or (never seen) the tally is out of
            # step with the memo.
            self._own_mtu = own_mtu
            self._mismatched, self._unknown = ([], []), ([], [])
            added = delta.results
        else:
            added = delta.added
        for entry in added:
            target = self._list_of(entry)
            if target is not None and entry is not None:
                keys, items = target
                at = bisect_right(keys, entry[0])
                keys.insert(at, entry[0])
                items.insert(at, entry[1])
        return MtuReport(own_mtu, list(self._mismatched[1]), list(self._unknown[1]))

    def _remove(self, entry: PeerOrder | None) -> bool:
        target = self._list_of(entry)
        if target is None or entry is None:
            return True
        keys, items = target
        at = bisect_left(keys, entry[0])
        while at < len(keys) and keys[at] == entry[0]:
            if items[at] == entry[1]:
                del keys[at], items[at]
                return True
            at += 1
        return False

    def _list_of(self, entry: PeerOrder | None) -> Sorted | None:
        if entry is None:
            return None
        advertised = entry[1].advertised
        if advertised is None:
            return self._unknown
        return self._mismatched if advertised != self._own_mtu else None


def _unknown(entries: Iterable[PeerOrder | None]) -> list[PeerMtu]:
    found = [e for e in entries if e is not None and e[1].advertised is None]
    found.sort(key=_ORDER)
    return [p for _, p in found]


def _report(own_mtu: int, found: Iterable[PeerOrder | None]) -> MtuReport:
    mismatched: list[PeerOrder] = []
    unknown: list[PeerOrder] = []
    for entry in found:
        if entry is None:
            continue
        advertised = entry[1].advertised
        if advertised is None:
            unknown.append(entry)
        elif advertised != own_mtu:
            mismatched.append(entry)
    mismatched.sort(key=_ORDER)
    unknown.sort(key=_ORDER)
    return MtuReport(own_mtu, [p for _, p in mismatched], [p for _, p in unknown])


# A peer's advertisement and where it sorts (Lease.order).
PeerOrder = tuple[tuple[int, int, int, int], PeerMtu]


def peer_mtu(lease: Lease) -> PeerOrder | None:
    """What one lease advertises (None: it has no address to name it by)."""
    ip = lease.attrs.public_ip or lease.attrs.public_ipv6
    if ip is None:
        return None
    return (lease.order, PeerMtu(lease.subnets[0], ip, lease.attrs.mtu))


_ORDER = operator.itemgetter(0)  # a PeerOrder's sort key, in C


def describe_mismatch(own_mtu: int, peer: PeerMtu) -> str:
    smaller = min(own_mtu, peer.advertised or own_mtu)
    return (
        f"peer {peer.subnet} ({peer.public_ip}) advertises overlay MTU {peer.advertised} "
        f"but this node uses {own_mtu}, so packets over {smaller} bytes between the two are "
        "dropped silently; give every node the same underlay MTU (or the same Backend MTU)"
    )


def runs_flanneld_vxlan_v6(lease: Lease) -> bool:
    """A flanneld lease (no MTU of ours) with a VXLAN VTEP over IPv6: flanneld gave that
    device underlay−50, 20 bytes more than VXLAN over IPv6 leaves room for."""
    data = lease.attrs.backend_v6_data or {}
    return (
        lease.attrs.mtu is None
        and lease.attrs.backend_type == "vxlan"
        and lease.attrs.public_ipv6 is not None
        and bool(data.get("VtepMAC"))
    )


def describe_unknown(peer: PeerMtu) -> str:
    return (
        f"peer {peer.subnet} ({peer.public_ip}) advertises no overlay MTU (flanneld or an "
        "older flannelpy), so only the prober's full-size DF probe can verify that path"
    )
