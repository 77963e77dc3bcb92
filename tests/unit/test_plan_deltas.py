"""A plan's set deltas: how its route, neighbour and FDB sets were made from the last
plan's, and the diff that takes its differences from them.

The reconciler's view after a pass holds the applied plan's own sets; the next plan,
made by the same memo, names those sets as its base. The diff then takes what to add
and delete from the delta instead of comparing every entry, and must answer exactly
what comparing answers.
"""

from __future__ import annotations

import random
from dataclasses import replace
from ipaddress import IPv4Address, IPv4Network

import pytest

from flannelpy.backend.base import EntriesMemo, PeerEntries, PlanMemo, node_bounds
from flannelpy.backend.registry import get_backend
from flannelpy.dataplane.diff import diff
from flannelpy.dataplane.state import DesiredState, Route, same_plan
from flannelpy.subnet.lease import Lease
from flannelpy.subnet.validate import split_peers
from tests.support.fakes import lease
from tests.unit.test_diff_reconciler import observed_from
from tests.unit.test_incremental_planning import CONTEXTS, MACS, own_lease, steps


def _check_exact(plan: DesiredState) -> None:
    for delta in plan.deltas:
        assert delta.added.isdisjoint(delta.base)
        assert delta.removed <= delta.base
        assert delta.result == (delta.base - delta.removed) | delta.added


def _delta_for(plan: DesiredState, entries: frozenset[object]) -> object | None:
    return next((d for d in plan.deltas if d.result is entries), None)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("name", sorted(CONTEXTS))
def test_a_plans_deltas_are_exact_and_its_diff_against_the_last_plan_is_the_compared_one(
    name: str, seed: int
) -> None:
    rnd = random.Random(f"deltas-{name}-{seed}")
    ctx = CONTEXTS[name]()
    dual = ctx.public_ipv6 is not None
    backend = get_backend(ctx.config.backend.type)
    memo = PlanMemo()
    own = [own_lease(1, dual, ctx)]
    last: DesiredState | None = None
    taken = 0
    for i, leases in enumerate(steps(rnd, dual, 30)):
        bounds = node_bounds(ctx, own, [])
        peers = list(split_peers({x.key: x for x in leases.values()}, [], bounds)[0].values())
        plan = backend.plan(ctx, own, peers, rnd.choice([MACS[0], MACS[0], MACS[1]]), memo)
        _check_exact(plan)
        assert same_plan(plan, last) == (plan == last) == same_plan(replace(plan, deltas=()), last)
        if last is not None:
            assert same_plan(plan, plan) and same_plan(replace(plan, deltas=()), plan)
            held = observed_from(last)  # the view after a pass that applied it
            with_deltas = diff(plan, held)
            assert with_deltas == diff(replace(plan, deltas=()), held), f"step {i}"
            delta = _delta_for(plan, plan.fdb)
            if delta is not None and delta.base is last.fdb:  # type: ignore[attr-defined]
                # The differences are the delta's own sets: nothing was compared.
                assert with_deltas.compared is not None
                assert with_deltas.compared.fdb_added is delta.added  # type: ignore[attr-defined]
                taken += 1
        last = plan
    if name.startswith("vxlan"):  # every IPv4 VTEP plan names the last one's FDB set
        assert taken >= 25, taken


def _peer(n: int) -> PeerEntries:
    route = Route(IPv4Network(f"10.{n}.0.0/24"), IPv4Address(f"100.64.0.{n}"), "eth0")
    return PeerEntries(routes=(route,))


def _leases(count: int) -> list[Lease]:
    return [lease(f"10.244.{n}.0/24", f"100.64.0.{n}") for n in range(count)]


def test_an_unchanged_union_is_the_last_set_and_a_lease_planned_alike_moves_nothing() -> None:
    memo = EntriesMemo()
    leases = _leases(3)
    entries = {id(lease): _peer(n) for n, lease in enumerate(leases)}

    def one(lease: Lease) -> PeerEntries:
        return entries[id(lease)]

    (routes, *_), deltas = memo.union("ctx", leases, one)
    assert len(routes) == 3 and deltas[0].added == routes and not deltas[0].removed
    (again, *_), deltas = memo.union("ctx", leases, one)
    assert again is routes  # nothing changed: not even a copy
    assert deltas[0].base is routes and not deltas[0].added and not deltas[0].removed
    # A lease replaced by another object planning the same route: dropped, then added.
    changed = replace(leases[1], attrs=replace(leases[1].attrs, mtu=1400))
    entries[id(changed)] = entries[id(leases[1])]
    (after, *_), deltas = memo.union("ctx", [leases[0], changed, leases[2]], one)
    assert after is routes and not deltas[0].added and not deltas[0].removed
    # One lease gone: its route is the one removed, from the last set itself.
    (fewer, *_), deltas = memo.union("ctx", [leases[0], changed], one)
    assert deltas[0].base is routes and deltas[0].result is fewer
    assert deltas[0].removed == frozenset(entries[id(leases[2])].routes) and not deltas[0].added


def test_a_compute_that_raises_leaves_no_count_behind() -> None:
    memo = EntriesMemo()
    leases = _leases(2)
    planned = {id(lease): _peer(n) for n, lease in enumerate(leases)}
    memo.union("ctx", leases[:1], lambda lease: planned[id(lease)])

    def fails(lease: Lease) -> PeerEntries:
        raise RuntimeError("bug")

    with pytest.raises(RuntimeError):
        memo.union("ctx", leases, fails)
    (routes, *_), deltas = memo.union("ctx", leases[1:], lambda lease: planned[id(lease)])
    assert routes == frozenset(planned[id(leases[1])].routes)  # leases[0]'s route is gone
    assert deltas[0].result is routes and deltas[0].added == routes and not deltas[0].base
