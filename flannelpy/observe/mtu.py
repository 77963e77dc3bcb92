"""MTU consistency between this node and its peers (pure).

Every flannelpy node advertises its overlay MTU with its lease (the
``"Flannelpy": {"MTU": ...}`` extension). Two nodes with different overlay MTUs
exchange packets that fit one side and not the other, and the larger ones are
dropped without an error (field notes §1). flanneld does not advertise an MTU,
so its leases are "unknown": never reported as a mismatch, only listed, and the
prober's DF probe is what verifies those paths.
"""

from __future__ import annotations

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
    """Peers whose advertised overlay MTU differs from ours, and how many advertise none."""

    own_mtu: int
    mismatched: list[PeerMtu] = field(default_factory=list)
    unknown: int = 0

    @property
    def consistent(self) -> bool:
        """No peer advertises an MTU different from ours (unknown peers do not count)."""
        return not self.mismatched

    def sentences(self) -> list[str]:
        """One sentence per mismatched peer, for logs and ``doctor``."""
        return [describe_mismatch(self.own_mtu, p) for p in self.mismatched]


def mtu_mismatches(own_mtu: int, peers: Iterable[Lease]) -> MtuReport:
    """Compare our overlay MTU with what each peer lease advertises.

    Output is sorted by subnet so logs and metrics are stable between runs."""
    return _report(own_mtu, [peer_mtu(lease, own_mtu) for lease in peers])


class MtuChange(NamedTuple):
    """:func:`follow_mtu`'s answer: the report, and the peers that came to advertise no
    MTU and stopped doing so since the memo's last call (by subnet)."""

    report: MtuReport
    unknown_arrived: list[PeerMtu]
    unknown_left: list[PeerMtu]


def follow_mtu(
    own_mtu: int,
    peers: Iterable[Lease],
    memo: LeaseMemo[PeerMtu | None],
    last: MtuReport | None,
    tally: MtuTally | None = None,
) -> MtuChange:
    """:func:`mtu_mismatches` for the writer's plans, which change a lease or two of
    thousands: ``memo`` keeps what each lease advertises unlike us (nothing for a peer of
    our MTU), ``last`` (the report of the memo's last call) stands while no lease changed
    and our MTU is the same, and what changed among the peers without an MTU comes from
    the leases that changed, not from comparing every peer's entry. ``tally`` (kept with
    ``memo``, given to every call or to none) holds the report between calls, changed by
    those leases too: without it, a change walks every peer."""
    delta = memo.update(own_mtu, peers, lambda lease: peer_mtu(lease, own_mtu))
    if last is not None and not delta.added and not delta.dropped and last.own_mtu == own_mtu:
        return MtuChange(last, [], [])
    report = _report(own_mtu, delta.results) if tally is None else tally.follow(own_mtu, delta)
    return MtuChange(report, _unknown(delta.added), _unknown(delta.dropped))


class MtuTally:
    """The last report's mismatched peers and its count of peers of unknown MTU, changed
    by the advertisements that came and went."""

    def __init__(self) -> None:
        self._own_mtu: int | None = None
        self._mismatched: set[PeerMtu] = set()
        self._unknown = 0

    def follow(self, own_mtu: int, delta: Delta[PeerMtu | None]) -> MtuReport:
        """The report after ``delta`` (the memo's answer for the same leases)."""
        if own_mtu != self._own_mtu or not all(map(self._remove, delta.dropped)):
            # Every peer judged again: our MTU changed, or (never seen) the tally is out of
            # step with the memo.
            self._own_mtu = own_mtu
            self._mismatched, self._unknown = set(), 0
            added = delta.results
        else:
            added = delta.added
        for entry in added:
            if entry is None:
                continue
            if entry.advertised is None:
                self._unknown += 1
            else:
                self._mismatched.add(entry)
        return MtuReport(own_mtu, sorted(self._mismatched, key=_sort_key), self._unknown)

    def _remove(self, entry: PeerMtu | None) -> bool:
        if entry is None:
            return True
        if entry.advertised is None:
            self._unknown -= 1
            return self._unknown >= 0
        if entry in self._mismatched:
            self._mismatched.discard(entry)
            return True
        return False


def _unknown(entries: Iterable[PeerMtu | None]) -> list[PeerMtu]:
    return sorted((e for e in entries if e is not None and e.advertised is None), key=_sort_key)


def _report(own_mtu: int, found: Iterable[PeerMtu | None]) -> MtuReport:
    mismatched: list[PeerMtu] = []
    unknown = 0
    for entry in found:
        if entry is None:
            continue
        if entry.advertised is None:
            unknown += 1
        elif entry.advertised != own_mtu:
            mismatched.append(entry)
    mismatched.sort(key=_sort_key)
    return MtuReport(own_mtu, mismatched, unknown)


def peer_mtu(lease: Lease, own_mtu: int | None = None) -> PeerMtu | None:
    """What one lease advertises; None when it has no address to name it by or, given
    ``own_mtu``, advertises that (nothing to report: most peers, kept as nothing)."""
    ip = lease.attrs.public_ip or lease.attrs.public_ipv6
    if ip is None or (own_mtu is not None and lease.attrs.mtu == own_mtu):
        return None
    return PeerMtu(lease.subnets[0], ip, lease.attrs.mtu)


def _sort_key(peer: PeerMtu) -> tuple[bool, int, int]:
    """Lease.order for the subnet an entry names: IPv6-only leases first, then by IPv4
    subnet (no two leases share their first subnet)."""
    subnet = peer.subnet
    return (subnet.version == 4, int(subnet.network_address), subnet.prefixlen)


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
