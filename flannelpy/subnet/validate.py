"""Peer leases are input from other machines: which ones may reach the kernel (pure).

A peer lease becomes routes, neighbours and FDB entries on this node, so a
lease that names the wrong subnet or a bogus address can take the node off
its own underlay (a lease for the underlay's subnet replaces its connected
route). :func:`check_peer` says why a lease must be ignored, or None;
:func:`split_peers` applies it to a whole lease list. The writer logs each
rejection once, counts it and shows it in the status file.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from ipaddress import IPv4Address, IPv4Network, IPv6Address, IPv6Network
from itertools import compress, repeat

from flannelpy.subnet.lease import Lease
from flannelpy.subnet.memo import LeaseList, LeaseMemo, LeaseSnapshot
from flannelpy.subnet.span import overlaps, within

# The reasons, a closed set (metric label values).
OUTSIDE_NETWORK = "outside-network"
OVERLAPS_OWN = "overlaps-own-lease"
OVERLAPS_HOST = "overlaps-node-address"
BAD_ADDRESS = "bad-public-ip"
OWN_ADDRESS = "own-public-ip"
BACKEND_DATA = "bad-backend-data"
UNDECODABLE = "undecodable"  # the manager could not parse the value at all
REASONS = (
    OUTSIDE_NETWORK,
    OVERLAPS_OWN,
    OVERLAPS_HOST,
    BAD_ADDRESS,
    OWN_ADDRESS,
    BACKEND_DATA,
    UNDECODABLE,
)

MAX_VNI = (1 << 24) - 1
_MAC = re.compile(r"^[0-9a-fA-F]{2}(:[0-9a-fA-F]{2}){5}$")


@dataclass(frozen=True)
class Rejection:
    key: str
    reason: str  # one of REASONS
    detail: str  # one sentence for the log and the doctor


@dataclass(frozen=True)
class Bounds:
    """What this node knows that a peer lease must not contradict."""

    networks: tuple[IPv4Network, ...]  # the config's Network and every pool
    own: tuple[IPv4Network, ...]  # our own lease subnets
    host: tuple[IPv4Network, ...]  # the node's connected subnets (the underlay's)
    public_ip: IPv4Address | None  # ours (None IPv6-only: ``networks`` is empty too)
    host_ips: tuple[IPv4Address, ...] = ()  # the node's own addresses
    # IPv6 (dual stack): the config's IPv6Network (empty: IPv6 off, a peer's IPv6 half is
    # then never programmed and not checked), our own IPv6 subnets, the node's connected
    # IPv6 subnets and addresses.
    ipv6_networks: tuple[IPv6Network, ...] = ()
    own6: tuple[IPv6Network, ...] = ()
    host6: tuple[IPv6Network, ...] = ()
    host_ips6: tuple[IPv6Address, ...] = ()


def check_peer(lease: Lease, bounds: Bounds) -> Rejection | None:
    """Why ``lease`` (another node's) must not be programmed, or None if it may be."""
    subnet, ip = lease.subnet, lease.attrs.public_ip

    def no(reason: str, detail: str) -> Rejection:
        return Rejection(lease.key, reason, detail)

    if subnet is None or ip is None or not bounds.networks:
        # An IPv6-only lease, or an IPv6-only node: only the IPv6 half is programmed.
        problem = backend_data_problem(lease)
        return no(BACKEND_DATA, problem) if problem is not None else check_peer_v6(lease, bounds)
    if not any(within(subnet, net) for net in bounds.networks):
        nets = ", ".join(str(n) for n in bounds.networks)
        return no(OUTSIDE_NETWORK, f"subnet {subnet} lies outside the network and pools ({nets})")
    mine = next((n for n in bounds.own if overlaps(n, subnet)), None)
    if mine is not None:
        return no(OVERLAPS_OWN, f"subnet {subnet} overlaps this node's own lease {mine}")
    host = next((n for n in bounds.host if n.prefixlen > 0 and overlaps(n, subnet)), None)
    if host is not None:
        return no(OVERLAPS_HOST, f"subnet {subnet} overlaps {host}, connected on this node")
    if any(a is not None and a in subnet for a in (bounds.public_ip, *bounds.host_ips)):
        return no(OVERLAPS_HOST, f"subnet {subnet} holds an address of this node")
    if (
        ip.is_loopback
        or ip.is_multicast
        or ip.is_unspecified
        or ip.is_link_local
        or ip == IPv4Address("255.255.255.255")
        or any(ip in net for net in bounds.networks)
    ):
        return no(BAD_ADDRESS, f"PublicIP {ip} cannot be a node's underlay address")
    if ip == bounds.public_ip or ip in bounds.host_ips:
        return no(OWN_ADDRESS, f"PublicIP {ip} is this node's own address")
    problem = backend_data_problem(lease)
    if problem is not None:
        return no(BACKEND_DATA, problem)
    return check_peer_v6(lease, bounds)


def check_peer_v6(lease: Lease, bounds: Bounds) -> Rejection | None:
    """The IPv6 half of :func:`check_peer`: the same rules for IPv6Subnet, PublicIPv6
    and BackendV6Data. A bad IPv6 half rejects the whole lease: programming only half
    of a peer would leave its pods reachable in one family and not the other, silently."""
    subnet6, ip6 = lease.ipv6_subnet, lease.attrs.public_ipv6
    if not bounds.ipv6_networks or (subnet6 is None and ip6 is None):
        return None

    def no(reason: str, detail: str) -> Rejection:
        return Rejection(lease.key, reason, detail)

    if subnet6 is not None:
        if not any(within(subnet6, net) for net in bounds.ipv6_networks):
            nets = ", ".join(str(n) for n in bounds.ipv6_networks)
            return no(OUTSIDE_NETWORK, f"IPv6 subnet {subnet6} lies outside IPv6Network ({nets})")
        mine = next((n for n in bounds.own6 if overlaps(n, subnet6)), None)
        if mine is not None:
            return no(OVERLAPS_OWN, f"IPv6 subnet {subnet6} overlaps this node's own {mine}")
        host = next((n for n in bounds.host6 if n.prefixlen > 0 and overlaps(n, subnet6)), None)
        if host is not None:
            return no(OVERLAPS_HOST, f"IPv6 subnet {subnet6} overlaps {host}, connected here")
        if any(a in subnet6 for a in bounds.host_ips6):
            return no(OVERLAPS_HOST, f"IPv6 subnet {subnet6} holds an address of this node")
    if ip6 is not None:
        if (
            ip6.is_loopback
            or ip6.is_multicast
            or ip6.is_unspecified
            or ip6.is_link_local
            or ip6.ipv4_mapped is not None
            or any(ip6 in net for net in bounds.ipv6_networks)
        ):
            return no(BAD_ADDRESS, f"PublicIPv6 {ip6} cannot be a node's underlay address")
        if ip6 in bounds.host_ips6:
            return no(OWN_ADDRESS, f"PublicIPv6 {ip6} is this node's own address")
    problem = _vxlan_data_problem(lease.attrs.backend_v6_data, "BackendV6Data")
    if problem is not None:
        return no(BACKEND_DATA, problem)
    return None


def backend_data_problem(lease: Lease) -> str | None:
    """What is wrong with the types of the lease's BackendData (VNI, VtepMAC), or None."""
    return _vxlan_data_problem(lease.attrs.backend_data, "BackendData")


def _vxlan_data_problem(data: Mapping[str, object] | None, name: str) -> str | None:
    if data is None:
        return None
    vni = data.get("VNI")
    if vni is not None and (
        not isinstance(vni, int) or isinstance(vni, bool) or not 0 <= vni <= MAX_VNI
    ):
        return f"{name}.VNI {_short(vni)} is not an integer in 0..{MAX_VNI}"
    mac = data.get("VtepMAC")
    if mac is not None and (not isinstance(mac, str) or not _MAC.match(mac)):
        return f"{name}.VtepMAC {_short(mac)} is not a MAC address"
    return None


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def split_peers(
    leases: Mapping[str, Lease],
    own_keys: Iterable[str],
    bounds: Bounds,
    memo: LeaseMemo[Rejection | None] | None = None,
) -> tuple[dict[str, Lease], dict[str, Rejection]]:
    """``leases`` without our own: the peers that may be programmed, and the rejected.
    ``memo`` keeps each lease's verdict for the next call (with the same bounds)."""
    others = dict(leases)
    for key in own_keys:
        others.pop(key, None)
    if memo is None:
        verdicts = [check_peer(lease, bounds) for lease in others.values()]
    else:
        verdicts = memo.results(bounds, others.values(), lambda x: check_peer(x, bounds))
    # In C over thousands of leases: the verdicts are None but for the few rejected.
    ok = list(map(operator.is_, verdicts, repeat(None)))
    accepted = dict(compress(others.items(), ok))
    rejected = (
        {key: why for key, why in zip(others, verdicts, strict=True) if why is not None}
        if not all(ok)
        else {}
    )
    return accepted, rejected


def check_own(lease: Lease, bounds: Bounds) -> Rejection | None:
    """Why a lease carrying our address must not be adopted as ours, or None."""
    subnet = lease.subnet
    if subnet is None or not bounds.networks:
        return _check_own_v6(lease, bounds)
    if not any(within(subnet, net) for net in bounds.networks):
        nets = ", ".join(str(n) for n in bounds.networks)
        detail = f"subnet {subnet} lies outside the network and pools ({nets})"
        return Rejection(lease.key, OUTSIDE_NETWORK, detail)
    host = next((n for n in bounds.host if n.prefixlen > 0 and overlaps(n, subnet)), None)
    if host is not None:
        detail = f"subnet {subnet} overlaps {host}, connected on this node"
        return Rejection(lease.key, OVERLAPS_HOST, detail)
    problem = backend_data_problem(lease)
    if problem is not None:
        return Rejection(lease.key, BACKEND_DATA, problem)
    return None


def _check_own_v6(lease: Lease, bounds: Bounds) -> Rejection | None:
    """:func:`check_own` for an IPv6-only lease: its IPv6 subnet inside IPv6Network."""
    subnet6 = lease.ipv6_subnet
    if subnet6 is None or not any(within(subnet6, n) for n in bounds.ipv6_networks):
        nets = ", ".join(str(n) for n in bounds.ipv6_networks) or "none"
        detail = f"IPv6 subnet {subnet6} lies outside IPv6Network ({nets})"
        return Rejection(lease.key, OUTSIDE_NETWORK, detail)
    problem = _vxlan_data_problem(lease.attrs.backend_v6_data, "BackendV6Data")
    return Rejection(lease.key, BACKEND_DATA, problem) if problem is not None else None


class PeerSplit:
    """:func:`split_peers` for one owner's successive lease maps, as
    :class:`~flannelpy.subnet.memo.LeaseList` s: the peers of each call are made after
    those of the last, so the memos fed with them apply what changed, and a verdict is
    reached once per lease object. What a call costs follows what changed, but for a
    copy of the map, and two passes over it in C unless the map is a
    :class:`~flannelpy.subnet.memo.LeaseSnapshot` made after the last one, whose changed
    keys are looked at alone. It answers exactly what :func:`split_peers` does (the unit
    tests compare the two over random sequences)."""

    def __init__(self) -> None:
        self._verdicts: LeaseMemo[Rejection | None] = LeaseMemo()
        self._others: LeaseList | None = None  # the leases but ours, of the last call
        self._peers: LeaseList | None = None  # the last call's answer
        self._rejected: dict[str, Rejection] = {}
        self._seen: tuple[object, frozenset[str]] | None = None  # last snapshot's token, own keys

    def split(
        self, leases: Mapping[str, Lease], own_keys: Iterable[str], bounds: Bounds
    ) -> tuple[LeaseList, dict[str, Rejection]]:
        """The peers that may be programmed, in the map's order, and the rejected (a new
        dict the caller may change)."""
        others_map = dict(leases)  # in C: thousands of leases, our one or two to drop
        own = frozenset(own_keys)
        for key in own:
            others_map.pop(key, None)
        last_others = self._others
        # A snapshot made after the last one, with the same own keys: only its changed
        # keys can hold other leases than the last list's.
        seen, self._seen = self._seen, None
        changed = None
        if isinstance(leases, LeaseSnapshot):
            self._seen = (leases.token, own)
            if seen == (leases.follows, own):
                changed = leases.changed
        others = self._others = LeaseList(others_map, last_others, changed)
        delta = self._verdicts.update(bounds, others, lambda lease: check_peer(lease, bounds))
        if delta.follows:  # verdicts line up with the leases that came and went
            rejected = self._rejected
            for lease in others.dropped:
                rejected.pop(lease.key, None)
            for lease, why in zip(others.added, delta.added, strict=True):
                if why is not None:
                    rejected[lease.key] = why
        else:
            verdicts = delta.results
            rejected = (
                {k.key: why for k, why in zip(others, verdicts, strict=True) if why is not None}
                if any(map(operator.is_not, verdicts, repeat(None)))
                else {}
            )
        self._rejected = rejected
        if rejected:  # in C: each lease's key looked up among the few rejected
            unwanted = map(rejected.__contains__, others_map)
            kept = compress(others_map.items(), map(operator.not_, unwanted))
            peers = LeaseList(dict(kept), self._peers)
        elif self._peers is None or self._peers is last_others:
            peers = others  # no lease rejected now or last time: the same list
        else:
            peers = LeaseList(others_map, self._peers)
        self._peers = peers
        return peers, dict(rejected)
