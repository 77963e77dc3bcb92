from dataclasses import replace
from ipaddress import IPv4Address, IPv4Network

from flannelpy.backend.registry import get_backend
from flannelpy.dataplane.diff import diff
from flannelpy.dataplane.reconciler import Reconciler
from flannelpy.dataplane.state import ObservedState, Route
from tests.support.fakes import FakeKernel, context, lease

MAC = "02:00:00:00:00:01"
OWN = lease("10.244.1.0/24", "192.168.1.10", mac=MAC)
PEERS = [
    lease(f"10.244.{i}.0/24", f"192.168.1.{10 + i}", mac=f"02:00:00:00:00:{i:02x}")
    for i in range(2, 6)
]


def desired(peers=PEERS, **options):  # type: ignore[no-untyped-def]
    return get_backend("vxlan").plan(context("vxlan", **options), [OWN], peers, MAC)


def observed_from(state) -> ObservedState:  # type: ignore[no-untyped-def]
    return ObservedState(
        links=state.links,
        addresses=state.addresses,
        routes=state.routes,
        neighbours=state.neighbours,
        fdb=state.fdb,
    )


def test_empty_kernel_gets_everything_in_recipe_order() -> None:
    changes = diff(desired(), ObservedState())
    assert len(changes.links_to_create) == 1
    assert (
        len(changes.neighbours_to_set) == len(changes.fdb_to_set) == len(changes.routes_to_set) == 4
    )
    assert changes.counts["route"] == 4 and changes.counts["stale"] == 0


def test_converged_state_yields_no_changes() -> None:
    want = desired()
    assert diff(want, observed_from(want)).empty


def test_removed_peer_entries_are_garbage_collected() -> None:
    have = observed_from(desired())
    changes = diff(desired(PEERS[:3]), have)
    assert [r.dst for r in changes.routes_to_delete] == [IPv4Network("10.244.5.0/24")]
    assert len(changes.neighbours_to_delete) == len(changes.fdb_to_delete) == 1
    assert not changes.routes_to_set


def test_changed_peer_address_replaces_its_fdb_entry() -> None:
    moved = replace(PEERS[0], attrs=replace(PEERS[0].attrs, public_ip=IPv4Address("192.168.1.99")))
    changes = diff(desired([moved, *PEERS[1:]]), observed_from(desired()))
    assert [f.dst for f in changes.fdb_to_delete] == [IPv4Address("192.168.1.12")]
    assert [f.dst for f in changes.fdb_to_set] == [IPv4Address("192.168.1.99")]


def test_vni_change_recreates_the_device_and_everything_on_it() -> None:
    have = observed_from(desired())
    want = desired()
    (link,) = want.links
    want = replace(want, links=frozenset({replace(link, port=4789)}))
    changes = diff(want, have)
    assert changes.links_to_delete == ("flannel.1",)
    assert len(changes.routes_to_set) == 4 and len(changes.neighbours_to_set) == 4


def test_mtu_change_is_applied_in_place() -> None:
    changes = diff(desired(mtu=9000), observed_from(desired()))
    assert not changes.links_to_delete and changes.links_to_update[0].mtu == 8950


def test_foreign_route_changes_to_ours_are_replaced() -> None:
    have = observed_from(desired())
    hijacked = Route(IPv4Network("10.244.2.0/24"), IPv4Address("192.168.1.1"), "eth0")
    routes = {r for r in have.routes if r.dst != hijacked.dst} | {hijacked}
    changes = diff(desired(), replace(have, routes=frozenset(routes)))
    assert [r.gateway for r in changes.routes_to_set] == [IPv4Address("10.244.2.0")]


def test_reconciler_does_nothing_before_desired_state_is_known() -> None:
    kernel = FakeKernel()
    assert Reconciler(kernel, 10).reconcile_once() is None
    assert kernel.observe_calls == 0


def test_reconciler_repairs_deleted_entries_and_reports_failures() -> None:
    kernel = FakeKernel()
    reconciler = Reconciler(kernel, 10)
    reconciler.set_desired(desired())
    assert reconciler.reconcile_once().converged  # type: ignore[union-attr]
    victim = next(iter(kernel.state.routes))
    kernel.state = replace(kernel.state, routes=kernel.state.routes - {victim})
    kernel.fail_next_routes = True
    result = reconciler.reconcile_once("route deleted")
    assert result is not None and not result.converged and "injected" in result.failures[0]
    result = reconciler.reconcile_once("retry")
    assert result is not None and result.converged
    assert victim in kernel.state.routes
    assert reconciler.reconcile_once().changes.empty  # type: ignore[union-attr]


def test_deleted_blackhole_route_is_set_again_and_kept_when_converged() -> None:
    want = get_backend("vxlan").plan(
        replace(context("vxlan"), blackhole_own_subnets=True), [OWN], PEERS, MAC
    )
    (hole,) = [r for r in want.routes if r.blackhole]
    assert hole.dst == IPv4Network("10.244.1.0/24")
    have = observed_from(want)
    assert diff(want, have).empty
    gone = replace(have, routes=have.routes - {hole})
    assert diff(want, gone).routes_to_set == (hole,)
    # Without the flag, a blackhole of ours left from an earlier run is removed.
    assert diff(desired(), have).routes_to_delete == (hole,)


def test_a_dump_is_told_the_plan_s_entries_on_the_devices_it_reads() -> None:
    """What a pass that reads the kernel expects to find: the plan's routes, neighbours and
    FDB entries (of the owned devices), the sets a dump of a kernel as planned reports."""
    kernel = FakeKernel()
    reconciler = Reconciler(kernel, 10)
    want = desired()
    reconciler.set_desired(want)
    assert reconciler.reconcile_once().converged  # type: ignore[union-attr]
    told = kernel.expected
    assert told is not None
    assert told.routes is want.routes
    assert told.neighbours == want.neighbours and told.fdb == want.fdb
    assert want.neighbours and want.fdb
