"""Desired minus observed: the pure heart of reconciliation.

Identity per kind: links by name, routes by destination, neighbours by
(device, IP), FDB entries by (device, MAC, dst), addresses by value. A link
whose immutable attributes differ (VNI, local address, port, ...) is deleted
and created again, and everything on it is then treated as missing.
"""

from __future__ import annotations

import operator
from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import replace
from ipaddress import IPv4Address, IPv4Network, IPv6Address, IPv6Network
from typing import TypeVar

from flannelpy.dataplane.state import (
    Address,
    Changes,
    Compared,
    DesiredState,
    FdbEntry,
    Neighbour,
    ObservedState,
    Route,
    SetDelta,
    VxlanLink,
    delta_between,
)

E = TypeVar("E", Route, Neighbour)


def _immutable(link: VxlanLink) -> tuple[object, ...]:
    return (link.vni, link.local_ip, link.underlay, link.port, link.gbp, link.learning)


def diff(
    desired: DesiredState, observed: ObservedState, identities: Identities | None = None
) -> Changes:
    """What to do so that the kernel's ``observed`` becomes ``desired``. ``identities``,
    when it counts ``observed``'s entries, saves walking them to learn that no identity
    is held twice (the answer is the same)."""
    distinct = identities.distinct(observed) if identities is not None else (False, False)
    to_delete, to_create, to_update = _links(desired, observed)

    # A created (or re-created) device starts empty, whatever the dump said.
    fresh = {link.name for link in to_create} | set(to_delete)
    if fresh:
        observed, distinct = _without_devices(observed, fresh), (False, False)

    deltas = desired.deltas
    routes_added, routes_unwanted = _differences_of(desired.routes, observed.routes, deltas)
    routes_to_set, routes_to_delete = _by_identity(
        desired.routes, observed.routes, routes_added, routes_unwanted, _route_ids, distinct[0]
    )
    routes_to_set.sort(key=_route_key)
    routes_to_delete.sort(key=_route_key)
    neighbours_added, neighbours_unwanted = _differences_of(
        desired.neighbours, observed.neighbours, deltas
    )
    neighbours_to_set, neighbours_to_delete = _by_identity(
        desired.neighbours,
        observed.neighbours,
        neighbours_added,
        neighbours_unwanted,
        _neigh_ids,
        distinct[1],
    )
    neighbours_to_set.sort(key=_neigh_key)
    neighbours_to_delete.sort(key=_neigh_key)

    fdb_added, fdb_unwanted = _differences_of(desired.fdb, observed.fdb, deltas)
    fdb_to_delete = sorted(fdb_unwanted, key=_fdb_key)
    fdb_to_set = sorted(fdb_added, key=_fdb_key)

    addresses_to_add = sorted(desired.addresses - observed.addresses, key=_addr_key)
    addresses_to_delete = sorted(observed.addresses - desired.addresses, key=_addr_key)

    counts = {
        "link": len(to_create) + len(to_update),
        "address": len(addresses_to_add),
        "route": len(routes_to_set),
        "neighbour": len(neighbours_to_set),
        "fdb": len(fdb_to_set),
        "stale": len(routes_to_delete)
        + len(neighbours_to_delete)
        + len(fdb_to_delete)
        + len(addresses_to_delete),
    }
    return Changes(
        links_to_delete=tuple(to_delete),
        links_to_create=tuple(to_create),
        links_to_update=tuple(to_update),
        routes_to_delete=tuple(routes_to_delete),
        neighbours_to_delete=tuple(neighbours_to_delete),
        fdb_to_delete=tuple(fdb_to_delete),
        addresses_to_add=tuple(addresses_to_add),
        addresses_to_delete=tuple(addresses_to_delete),
        neighbours_to_set=tuple(neighbours_to_set),
        fdb_to_set=tuple(fdb_to_set),
        routes_to_set=tuple(routes_to_set),
        counts=counts,
        compared=Compared(
            not fresh,
            (routes_added, routes_unwanted),
            (neighbours_added, neighbours_unwanted),
            fdb_added,
        ),
    )


S = TypeVar("S", Route, Neighbour, FdbEntry)


def _differences_of(
    desired: frozenset[S], observed: frozenset[S], deltas: Sequence[SetDelta] = ()
) -> tuple[frozenset[S], frozenset[S]]:
    """(desired - observed, observed - desired): a delta's own when ``desired`` was made
    from ``observed`` itself (the plan after the one the view holds); else the second
    from the first's size when it must be empty: a pass adds or deletes a peer's entries
    among thousands, and then one of the two is (each walks one whole set, in C)."""
    delta = delta_between(deltas, desired, observed)
    if delta is not None:
        return delta.added, delta.removed
    if len(desired) >= len(observed):
        added = desired - observed
        if len(desired) - len(added) == len(observed):  # every observed entry is desired
            return added, frozenset()
        return added, observed - desired
    unwanted = observed - desired
    if len(observed) - len(unwanted) == len(desired):  # every desired entry is observed
        return frozenset(), unwanted
    return desired - observed, unwanted


def _links(
    desired: DesiredState, observed: ObservedState
) -> tuple[list[str], list[VxlanLink], list[VxlanLink]]:
    """(to delete, to create, to update): a device whose immutable attributes differ is
    deleted and created again."""
    observed_links = {link.name: link for link in observed.links}
    desired_links = {link.name: link for link in desired.links}
    to_delete: list[str] = [name for name in observed_links if name not in desired_links]
    to_create: list[VxlanLink] = []
    to_update: list[VxlanLink] = []
    for name, want in sorted(desired_links.items()):
        have = observed_links.get(name)
        if have is None:
            to_create.append(want)
        elif _immutable(have) != _immutable(want):
            to_delete.append(name)
            to_create.append(want)
        elif have.mtu != want.mtu or (want.mac is not None and have.mac != want.mac):
            to_update.append(want)
    return to_delete, to_create, to_update


def _by_identity(
    desired: frozenset[E],
    observed: frozenset[E],
    added: frozenset[E],
    unwanted: frozenset[E],
    ids: Callable[[Iterable[E]], list[Hashable]],
    distinct: bool = False,
) -> tuple[list[E], list[E]]:
    """(to set, to delete) of entries identified by ``ids`` (a route by its destination,
    a neighbour by device and IP; ``ids`` maps entries to theirs in order): a desired
    entry the kernel lacks or holds otherwise is set; an observed one whose identity
    nothing desired has is deleted.

    A plan shares its unchanged entries with the kernel's view the last pass left (the
    same objects), so the two set differences (which compare the hashes the sets keep),
    are all a pass for a new peer needs; identities are computed for every observed entry
    only when something observed is unwanted and ``distinct`` (no two observed entries
    share an identity, as :class:`Identities` knows) is not known, and for every desired
    one only when two observed entries share an identity. ``added`` and ``unwanted`` are
    ``desired - observed`` and ``observed - desired``."""
    if not unwanted:  # every observed entry is desired as it is
        return list(added), []
    by_identity: dict[Hashable, E] = {}
    if not distinct:
        by_identity = dict(zip(ids(observed), observed, strict=True))
        distinct = len(by_identity) == len(observed)
    if distinct:
        # Each observed entry is the only one of its identity: one that is also desired
        # is left alone, and an unwanted one is replaced if an added entry has its
        # identity, else deleted.
        added_ids = set(ids(added))
        return list(added), [
            entry
            for entry, key in zip(unwanted, ids(unwanted), strict=True)
            if key not in added_ids
        ]
    wanted = set(ids(desired))
    to_delete = [
        entry for entry, key in zip(unwanted, ids(unwanted), strict=True) if key not in wanted
    ]
    to_set = [
        entry
        for entry, key in zip(desired, ids(desired), strict=True)
        if (have := by_identity.get(key)) is not entry and have != entry
    ]
    return to_set, to_delete


# Identities as ipaddress compares addresses and networks (family, integer, prefix
# length), read from its slots in C: an address's own __hash__ runs Python (a few
# milliseconds per thousand entries), and a deletion needs every observed entry's.
_IP = operator.attrgetter("_ip")
_PREFIXLEN = operator.attrgetter("_prefixlen")


def _route_ids(routes: Iterable[Route]) -> list[Hashable]:
    """Each route's identity: its destination."""
    return [(type(dst := r.dst), _IP(dst.network_address), _PREFIXLEN(dst)) for r in routes]


def _neigh_ids(neighbours: Iterable[Neighbour]) -> list[Hashable]:
    """Each neighbour's identity: its device and IP."""
    return [(n.ifname, type(ip := n.ip), _IP(ip)) for n in neighbours]


_DST = operator.attrgetter("dst")


class Identities:
    """How many of a kernel view's routes share each destination, and its neighbours
    each device and address: a pass that deletes or replaces must know that no identity
    is held twice (deleting by identity would take the other), and learning it from the
    entries walks them all, in Python. The reconciler keeps one from pass to pass, changed by
    the entries that came and went (a plan's sets hash their entries once, and the
    destinations and addresses are the entries' own objects, so it holds no new ones)."""

    def __init__(self, observed: ObservedState) -> None:
        self.routes, self.neighbours = observed.routes, observed.neighbours
        self._dsts: Counter[IPv4Network | IPv6Network] = Counter(map(_DST, observed.routes))
        self._ips: dict[str, Counter[IPv4Address | IPv6Address]] = {}
        self._count(observed.neighbours, 1)

    def distinct(self, observed: ObservedState) -> tuple[bool, bool]:
        """Whether no two of ``observed``'s routes, and no two of its neighbours, share
        an identity; (False, False) for a view this does not count."""
        if observed.routes is not self.routes or observed.neighbours is not self.neighbours:
            return False, False
        ips = sum(map(len, self._ips.values()))
        return len(self._dsts) == len(self.routes), ips == len(self.neighbours)

    def follow(self, view: ObservedState, compared: Compared | None = None) -> None:
        """Count ``view`` (the kernel after a pass over the view this counts) instead.
        ``compared``: what the pass's diff found, when it compared this view with the
        plan that ``view`` holds (its differences are then the view's, not computed)."""
        routes = _differences(self.routes, view.routes, compared.routes if compared else None)
        dsts = self._dsts
        for route in routes[1]:
            dsts[route.dst] -= 1
            if not dsts[route.dst]:
                del dsts[route.dst]
        dsts.update(map(_DST, routes[0]))
        neighbours = _differences(
            self.neighbours, view.neighbours, compared.neighbours if compared else None
        )
        self._count(neighbours[1], -1)
        self._count(neighbours[0], 1)
        self.routes, self.neighbours = view.routes, view.neighbours

    def _count(self, neighbours: Iterable[Neighbour], step: int) -> None:
        for n in neighbours:
            on = self._ips.setdefault(n.ifname, Counter())
            on[n.ip] += step
            if not on[n.ip]:
                del on[n.ip]
                if not on:
                    del self._ips[n.ifname]


def _differences(
    before: frozenset[E], after: frozenset[E], compared: tuple[frozenset[E], frozenset[E]] | None
) -> tuple[frozenset[E], frozenset[E]]:
    """(came, gone) from ``before`` to ``after``: the diff's (added, unwanted) when it
    compared ``before`` with ``after``, else computed as the diff computes them."""
    return compared if compared is not None else _differences_of(after, before)


def _without_devices(observed: ObservedState, devices: set[str]) -> ObservedState:
    if not devices:
        return observed
    return replace(
        observed,
        addresses=frozenset(a for a in observed.addresses if a.ifname not in devices),
        routes=frozenset(r for r in observed.routes if r.ifname not in devices),
        neighbours=frozenset(n for n in observed.neighbours if n.ifname not in devices),
        fdb=frozenset(f for f in observed.fdb if f.ifname not in devices),
    )


def _route_key(route: Route) -> tuple[int, int]:
    return (int(route.dst.network_address), route.dst.prefixlen)


def _neigh_key(neigh: Neighbour) -> tuple[str, int]:
    return (neigh.ifname, int(neigh.ip))


def _fdb_key(entry: FdbEntry) -> tuple[str, str, int]:
    return (entry.ifname, entry.mac, int(entry.dst))


def _addr_key(addr: Address) -> tuple[str, int]:
    return (addr.ifname, int(addr.address))
