"""The diff of routes and neighbours by identity against the plain definition, on
entries shared with the last plan, changed, new, gone and duplicated in the kernel."""

from __future__ import annotations

from dataclasses import replace
from ipaddress import IPv4Address, IPv4Network, IPv6Address, IPv6Network

from hypothesis import example, given, settings
from hypothesis import strategies as st

from flannelpy.dataplane.diff import Identities, diff
from flannelpy.dataplane.state import DesiredState, FdbEntry, Neighbour, ObservedState, Route

DEV = "flannel.1"


def route(i: int, gateway: int, onlink: bool = True) -> Route:
    dst = IPv4Network((0x0AF40000 + (i << 8), 24))
    return Route(dst, IPv4Address(0xC0A80000 + gateway), DEV, onlink=onlink)


def neighbour(i: int, mac: int) -> Neighbour:
    return Neighbour(DEV, IPv4Address(0x0AF40000 + (i << 8)), f"02:aa:00:00:00:{mac:02x}")


def by_definition(
    desired: frozenset[Route] | frozenset[Neighbour],
    observed: frozenset[Route] | frozenset[Neighbour],
    identity: object,
) -> tuple[set[object], set[object]]:
    """Set what the kernel lacks or holds otherwise; delete what nothing desired names."""
    key = identity  # a function of an entry
    have = {key(e): e for e in observed}  # type: ignore[operator]
    wanted = {key(e) for e in desired}  # type: ignore[operator]
    return (
        {e for e in desired if have.get(key(e)) != e},  # type: ignore[operator]
        {e for e in observed if key(e) not in wanted},  # type: ignore[operator]
    )


# A peer: index, then what its entry looks like in the kernel and in the plan.
peer = st.tuples(
    st.integers(0, 15),
    st.sampled_from(["both", "kernel only", "plan only", "changed", "kernel twice"]),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(peer, max_size=12, unique_by=lambda p: p[0]))
def test_the_diff_by_identity_is_the_plain_definition(peers: list[tuple[int, str]]) -> None:
    kernel_routes: set[Route] = set()
    plan_routes: set[Route] = set()
    kernel_neigh: set[Neighbour] = set()
    plan_neigh: set[Neighbour] = set()
    for i, how in peers:
        r, n = route(i, i), neighbour(i, i)  # the same objects in plan and kernel
        if how in ("both", "kernel only", "changed", "kernel twice"):
            kernel_routes.add(r)
            kernel_neigh.add(n)
        if how in ("both", "plan only", "kernel twice"):
            plan_routes.add(r)
            plan_neigh.add(n)
        if how == "changed":  # the plan has it otherwise: a new gateway, a new MAC
            plan_routes.add(route(i, i + 100))
            plan_neigh.add(neighbour(i, i + 100))
        if how == "kernel twice":  # a second route of the same destination (another metric)
            kernel_routes.add(route(i, i + 200, onlink=False))
    desired = DesiredState(routes=frozenset(plan_routes), neighbours=frozenset(plan_neigh))
    observed = ObservedState(routes=frozenset(kernel_routes), neighbours=frozenset(kernel_neigh))

    changes = diff(desired, observed)
    # Told by Identities that no identity is held twice, when none is: the same answer.
    assert diff(desired, observed, Identities(observed)) == changes

    to_set, to_delete = by_definition(desired.routes, observed.routes, lambda r: r.dst)
    assert set(changes.routes_to_set) == to_set
    assert set(changes.routes_to_delete) == to_delete
    to_set, to_delete = by_definition(
        desired.neighbours, observed.neighbours, lambda n: (n.ifname, n.ip)
    )
    assert set(changes.neighbours_to_set) == to_set
    assert set(changes.neighbours_to_delete) == to_delete
    assert list(changes.routes_to_set) == sorted(
        changes.routes_to_set, key=lambda r: int(r.dst.network_address)
    )


def test_identities_of_the_two_families_never_meet() -> None:
    """0.0.0.0/8 and ::/8 have the same number and length; the IPv4 route added does not
    replace the unwanted IPv6 one, which is deleted (so with neighbours of one number)."""
    v4 = Route(IPv4Network("0.0.0.0/8"), IPv4Address("192.168.0.1"), DEV, onlink=True)
    v6 = Route(IPv6Network("::/8"), IPv6Address("fe80::1"), DEV)
    n4 = Neighbour(DEV, IPv4Address(1), "02:aa:00:00:00:01")
    n6 = Neighbour(DEV, IPv6Address(1), "02:aa:00:00:00:01")
    kernel = ObservedState(routes=frozenset({v6}), neighbours=frozenset({n6}))
    plan = DesiredState(routes=frozenset({v4}), neighbours=frozenset({n4}))
    for counted in (None, Identities(kernel)):
        changes = diff(plan, kernel, counted)
        assert changes.routes_to_set == (v4,) and changes.routes_to_delete == (v6,)
        assert changes.neighbours_to_set == (n4,) and changes.neighbours_to_delete == (n6,)


def _distinct_by_definition(view: ObservedState) -> tuple[bool, bool]:
    routes = [r.dst for r in view.routes]
    neighbours = [(n.ifname, n.ip) for n in view.neighbours]
    return len(set(routes)) == len(routes), len(set(neighbours)) == len(neighbours)


# A view: each of 10 peers absent, once, or twice (a second route or neighbour of the same
# identity), on one of two devices.
view_entries = st.lists(st.tuples(st.integers(0, 9), st.integers(0, 2), st.booleans()), max_size=10)


def _view(entries: list[tuple[int, int, bool]], shared: dict[object, object]) -> ObservedState:
    """The view of ``entries``; entries equal to earlier ones are the same objects, as
    a plan's unchanged entries are."""
    routes: set[Route] = set()
    neighbours: set[Neighbour] = set()
    for i, times, other_device in entries:
        for copy in range(times):
            r = route(i, i + 100 * copy, onlink=copy == 0)
            n = replace(neighbour(i, i + copy), ifname="flannel-v6.1" if other_device else DEV)
            routes.add(shared.setdefault(r, r))  # type: ignore[arg-type]
            neighbours.add(shared.setdefault(n, n))  # type: ignore[arg-type]
    return ObservedState(routes=frozenset(routes), neighbours=frozenset(neighbours))


@settings(max_examples=200, deadline=None)
@given(st.lists(view_entries, min_size=1, max_size=8))
def test_identities_followed_from_view_to_view_are_counted_as_anew(
    views: list[list[tuple[int, int, bool]]],
) -> None:
    """The reconciler's Identities, changed by what came and went from one view to the
    next, say what counting each view anew says (and what the definition says), and
    nothing for a view they do not count."""
    shared: dict[object, object] = {}
    first = _view(views[0], shared)
    counted = Identities(first)
    assert counted.distinct(first) == _distinct_by_definition(first)
    for entries in views[1:]:
        view = _view(entries, shared)
        counted.follow(view)
        assert counted.distinct(view) == Identities(view).distinct(view)
        assert counted.distinct(view) == _distinct_by_definition(view)
    assert counted.distinct(_view([(0, 1, False)], {})) == (False, False)  # not the view counted


@settings(max_examples=200, deadline=None)
@given(st.sets(st.integers(0, 30)), st.sets(st.integers(0, 30)))
@example({1, 2, 3}, {1, 2})  # a peer added
@example({1, 2}, {1, 2, 3})  # a peer deleted
@example({1, 2, 4}, {1, 2, 3})  # one of each: as many planned as held
def test_fdb_entries_set_and_deleted_are_the_set_differences(
    planned: set[int], held: set[int]
) -> None:
    """Whichever side is larger, and whether one side holds the other (a peer added or
    deleted, as most passes) or not: what is set is planned and not held, what is
    deleted is held and not planned."""

    def entry(i: int) -> FdbEntry:
        return FdbEntry(DEV, f"02:aa:00:00:00:{i:02x}", IPv4Address(0xC0A80000 + i))

    desired = DesiredState(fdb=frozenset(map(entry, planned)))
    observed = ObservedState(fdb=frozenset(map(entry, held)))
    changes = diff(desired, observed)
    assert set(changes.fdb_to_set) == set(map(entry, planned - held))
    assert set(changes.fdb_to_delete) == set(map(entry, held - planned))
