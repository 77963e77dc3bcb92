"""Work per event in proportion to what changed, with the results of doing it all again.

Planning with the per-lease memo gives exactly what planning from scratch gives.

Random sequences of lease changes (peers joining, leaving, changing their VTEP MAC,
address, backend, MTU or DirectRouting, bogus leases, our own lease moving) are
planned twice at every step: with one memo kept across the whole sequence, and
without any. Both plans must be equal, field by field; so must the validation
verdicts and the MTU report. At the agent level, a writer fed such a sequence event
by event holds the plan, rejections and MTU report that planning its lease list from
scratch gives. A burst of lease lists costs one plan; a pass for
a new plan knows the kernel from the last pass, and leaves it as a pass that reads the
kernel would; status.json renders only the probe results that changed.
"""

from __future__ import annotations

import json
import random
import threading
from collections.abc import Hashable, Iterable
from dataclasses import replace
from ipaddress import IPv4Address, IPv4Network, IPv6Address, IPv6Network
from pathlib import Path

import pytest

from flannelpy.agent.events import Event, LeasesChanged, Tick
from flannelpy.agent.status import ProbesJson
from flannelpy.backend.base import NodeContext, PlanMemo, node_bounds
from flannelpy.backend.registry import get_backend
from flannelpy.dataplane import diff as diff_module
from flannelpy.dataplane import reconciler as reconciler_module
from flannelpy.dataplane.diff import Identities, diff
from flannelpy.dataplane.reconciler import FULL_DUMP_SECONDS, PERIODIC, PLAN_CHANGED, Reconciler
from flannelpy.dataplane.state import Changes, DesiredState, Neighbour, ObservedState, Route
from flannelpy.observe.mtu import MtuReport, MtuTally, follow_mtu, mtu_mismatches
from flannelpy.observe.probe_verdict import ProbeResult
from flannelpy.subnet.lease import Lease, LeaseAttrs
from flannelpy.subnet.memo import LeaseList, LeaseMemo
from flannelpy.subnet.validate import PeerSplit, split_peers
from tests.support.agent_fakes import AgentHarness
from tests.support.fakes import FakeKernel, context, lease
from tests.unit.test_dual_stack_node import ctx as dual_ctx

MACS = [f"02:00:00:00:{i // 256:02x}:{i % 256:02x}" for i in range(1, 40)]


def random_lease(rnd: random.Random, n: int, dual: bool) -> Lease:
    """Peer ``n``'s lease in one of many shapes, some of them bogus."""
    backend = rnd.choice(["vxlan", "vxlan", "vxlan", "host-gw", "wireguard"])
    mac = rnd.choice([*MACS, None, "not-a-mac"])
    data: dict[str, object] | None = {"VNI": rnd.choice([1, 1, 1, 2]), "VtepMAC": mac}
    if backend != "vxlan":
        data = rnd.choice([None, data])
    segment = rnd.choice([1, 1, 2])
    ip = rnd.choice([f"192.168.{segment}.{n + 20}", "192.168.1.10", "127.0.0.1", "10.244.9.9"])
    subnet = IPv4Network(f"10.244.{n}.0/24") if rnd.random() > 0.03 else IPv4Network("10.9.0.0/24")
    ipv6 = dual and rnd.random() > 0.2
    return Lease(
        subnet=subnet,
        ipv6_subnet=IPv6Network(f"fc00:0:0:{n:x}::/64") if ipv6 else None,
        attrs=LeaseAttrs(
            public_ip=IPv4Address(ip),
            backend_type=backend,
            backend_data=data,
            public_ipv6=IPv6Address(f"fd00:64::{n + 20:x}") if ipv6 else None,
            backend_v6_data=data if ipv6 else None,
            mtu=rnd.choice([1450, 1450, 1430, None]),
            direct_routing=rnd.choice([None, None, True]),
            node_name=f"node-{n}",
        ),
    )


def own_lease(n: int, dual: bool, ctx: NodeContext) -> Lease:
    return Lease(
        subnet=IPv4Network(f"10.244.{n}.0/24"),
        ipv6_subnet=IPv6Network(f"fc00:0:0:{n:x}::/64") if dual else None,
        attrs=LeaseAttrs(
            public_ip=ctx.public_ip,
            backend_type=ctx.config.backend.type,
            public_ipv6=ctx.public_ipv6,
        ),
    )


def steps(rnd: random.Random, dual: bool, count: int) -> list[dict[int, Lease]]:
    """``count`` lease maps (peer number -> lease), each a few changes from the last."""
    leases: dict[int, Lease] = {n: random_lease(rnd, n, dual) for n in rnd.sample(range(2, 60), 20)}
    out = [dict(leases)]
    for _ in range(count):
        for _ in range(rnd.choice([1, 1, 1, 2, 5])):
            n = rnd.randrange(2, 60)
            if n in leases and rnd.random() < 0.3:
                del leases[n]
            else:
                leases[n] = random_lease(rnd, n, dual)
        out.append(dict(leases))
    return out


CONTEXTS = {
    "vxlan": lambda: context("vxlan"),
    "vxlan-direct-routing": lambda: context("vxlan", direct_routing=True),
    "host-gw": lambda: context("host-gw"),
    "vxlan-blackhole": lambda: replace(context("vxlan"), blackhole_own_subnets=True),
    "dual-vxlan": lambda: dual_ctx("vxlan"),
    "dual-host-gw": lambda: dual_ctx("host-gw"),
}


def _subnet_order(subnet: IPv4Network | IPv6Network) -> tuple[bool, int, int]:
    """The report's order: IPv6-only leases first, then by IPv4 subnet."""
    return (subnet.version == 4, int(subnet.network_address), subnet.prefixlen)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("name", sorted(CONTEXTS))
def test_a_memo_plan_equals_a_plan_from_scratch(name: str, seed: int) -> None:
    rnd = random.Random(f"{name}-{seed}")
    ctx = CONTEXTS[name]()
    dual = ctx.public_ipv6 is not None
    backend = get_backend(ctx.config.backend.type)
    memo, verdicts, mtus = PlanMemo(), LeaseMemo(), LeaseMemo()  # type: ignore[var-annotated]
    tally = MtuTally()
    report: MtuReport | None = None
    # The planner's way: the peers as lists made one after another (PeerSplit), which
    # the memos follow by what came and went; now and then one memo misses a list.
    split, followed, followed_mtus = PeerSplit(), PlanMemo(), LeaseMemo()  # type: ignore[var-annotated]
    followed_tally = MtuTally()
    followed_report: MtuReport | None = None
    follows = 0
    last_peers: list[Lease] = []
    own = [own_lease(1, dual, ctx)]
    for i, leases in enumerate(steps(rnd, dual, 40)):
        if i % 13 == 12:  # our lease moves now and then: everything is planned anew
            own = [own_lease(rnd.choice([1, 70, 71]), dual, ctx)]
        by_key = {lease.key: lease for lease in leases.values()}
        bounds = node_bounds(ctx, own, [])
        own_keys = [lease.key for lease in own]
        fresh = split_peers(by_key, own_keys, bounds)
        assert split_peers(by_key, own_keys, bounds, verdicts) == fresh, f"step {i}"
        peers = list(fresh[0].values())
        listed, rejected = split.split(by_key, own_keys, bounds)
        assert (listed, rejected) == (peers, fresh[1]), f"step {i}"
        follows += listed.follows is not None
        mac = rnd.choice([MACS[0], MACS[0], MACS[1]])
        want = backend.plan(ctx, own, peers, mac)
        got = backend.plan(ctx, own, peers, mac, memo)
        assert got == want, f"step {i}"
        if i % 9 != 4:
            assert backend.plan(ctx, own, listed, mac, followed) == want, f"step {i}"
        if i % 7 != 3:
            followed_report, _, _ = follow_mtu(
                1450, listed, followed_mtus, followed_report, followed_tally
            )
            assert followed_report == mtu_mismatches(1450, peers), f"step {i}"
        before_ids = set(map(id, last_peers))
        report, arrived, left = follow_mtu(1450, peers, mtus, report, tally)
        assert report == mtu_mismatches(1450, peers), f"step {i}"
        # What came and went among the peers without an MTU, lease by lease (a changed
        # lease is a new one: the old leaves and the new arrives).
        now_ids = set(map(id, peers))
        unknown = [p for p in peers if p.attrs.mtu is None]
        was_unknown = [p for p in last_peers if p.attrs.mtu is None]
        assert [p.subnet for p in arrived] == sorted(
            (p.subnets[0] for p in unknown if id(p) not in before_ids), key=_subnet_order
        ), f"step {i}"
        assert [p.subnet for p in left] == sorted(
            (p.subnets[0] for p in was_unknown if id(p) not in now_ids), key=_subnet_order
        ), f"step {i}"
        last_peers = peers
    assert follows == 40  # every list but the first was made after the last


def test_the_memo_plans_only_the_leases_that_changed() -> None:
    ctx = context("vxlan")
    rnd = random.Random(1)
    leases = [random_lease(rnd, n, False) for n in range(2, 30)]
    planned: list[Lease] = []
    memo: LeaseMemo[int] = LeaseMemo()

    def compute(lease: Lease) -> int:
        planned.append(lease)
        return (lease.attrs.mtu or 0) * 100 + lease.ipv4_subnet.network_address.packed[2]

    memo.results(ctx, leases, compute)
    assert sorted(map(id, planned)) == sorted(map(id, leases))
    planned.clear()
    changed = replace(leases[3], attrs=replace(leases[3].attrs, mtu=1400))
    delta = memo.update(ctx, [*leases[:3], changed, *leases[4:-1]], compute)
    assert planned == [changed]  # the other leases are the same objects
    assert delta.added == [140005]  # the changed lease's new result; its old one dropped
    assert sorted(delta.dropped) == sorted([compute(leases[3]), compute(leases[-1])])
    assert delta.results == [compute(x) for x in [*leases[:3], changed, *leases[4:-1]]]
    planned.clear()
    memo.results(context("host-gw"), leases, compute)  # another context: all again
    assert sorted(map(id, planned)) == sorted(map(id, leases))


def test_a_memo_fed_lists_made_one_after_another_computes_what_came_and_went() -> None:
    ctx = context("vxlan")
    rnd = random.Random(3)
    leases = [random_lease(rnd, n, False) for n in range(2, 30)]
    computed: list[Lease] = []

    def compute(lease: Lease) -> int:
        computed.append(lease)
        return int(lease.ipv4_subnet.network_address)

    memo: LeaseMemo[int] = LeaseMemo()
    first = LeaseList(leases)
    assert memo.results(ctx, first, compute) == list(map(compute, leases))
    computed.clear()
    changed = replace(leases[3], attrs=replace(leases[3].attrs, mtu=1400))
    second = first.after([*leases[:3], changed, *leases[4:-1]])
    assert second.added == [changed]
    assert sorted(map(id, second.dropped)) == sorted(map(id, [leases[3], leases[-1]]))
    delta = memo.update(ctx, second, compute)
    assert delta.follows and computed == [changed]  # nothing else walked in Python
    # The results line up with the list's leases that came and went.
    assert delta.added == [compute(changed)]
    assert delta.dropped == [compute(x) for x in second.dropped]
    assert delta.results == list(map(compute, second))
    # A list made after one the memo never saw: every lease looked at again, same answer.
    third = LeaseList(leases).after(leases[:5])
    delta = memo.update(ctx, third, compute)
    assert not delta.follows and delta.results == list(map(compute, leases[:5]))
    assert sorted(delta.dropped) == sorted(map(compute, [changed, *second[5:]]))
    # A compute that raises leaves nothing half-done for the next list to follow.
    fourth = third.after([*leases[:5], *leases[10:12]])

    def failing(lease: Lease) -> int:
        if lease is leases[11]:
            raise ValueError("bad lease")
        return compute(lease)

    with pytest.raises(ValueError):
        memo.update(ctx, fourth, failing)
    delta = memo.update(ctx, fourth.after(leases[:6]), compute)
    assert not delta.follows and delta.results == list(map(compute, leases[:6]))


def test_a_list_made_of_a_lease_map_finds_what_came_and_went_by_key() -> None:
    rnd = random.Random(4)
    a, b, c, d = (random_lease(rnd, n, False) for n in (2, 3, 4, 5))
    changed = replace(b, attrs=replace(b.attrs, mtu=1400))
    first = LeaseList({"a": a, "b": b, "c": c})
    second = first.after({"a": a, "b": changed, "d": d})  # b changed, c gone, d new
    assert second == [a, changed, d] and second.follows is first.token
    assert second.added == [changed, d] and second.dropped == [b, c]
    # One lease object under another key: not a change a memo can follow by objects.
    moved = second.after({"a": a, "b": changed, "e": d})
    assert moved.follows is None and moved == [a, changed, d]
    # A map after a list of objects: every lease came and went, so none is followed.
    assert LeaseList([a, b]).after({"a": a, "b": b}).follows is None


def peer_json(rnd: random.Random, n: int) -> bytes:
    lease = random_lease(rnd, n, False)
    return lease.attrs.to_json().encode()


@pytest.mark.parametrize("seed", range(3))
def test_an_agent_fed_event_by_event_plans_what_a_plan_from_scratch_gives(
    tmp_path: Path, seed: int
) -> None:
    rnd = random.Random(seed)
    agent = AgentHarness(tmp_path)
    try:
        writer = agent.writer
        writer.acquire_first()
        for step in range(40):
            for _ in range(rnd.choice([1, 1, 3])):
                n = rnd.randrange(2, 40)
                key = f"/coreos.com/network/subnets/10.244.{n}.0-24"
                held = agent.store.get(key)
                if held is not None and rnd.random() < 0.25:
                    agent.store.delete_if_mod_revision(key, held.mod_revision)
                elif n != writer.state.own[0].ipv4_subnet.network_address.packed[2]:
                    agent.store.put(key, peer_json(rnd, n))
            agent.deliver_leases()
            if step % 10 != 9:
                continue
            s = writer.state
            seen = (writer.reconciler.desired, dict(s.rejected), s.mtu_report, s.unreachable)
            writer.planner.forget()
            writer.planner.replan()
            assert (writer.reconciler.desired, s.rejected, s.mtu_report, s.unreachable) == seen
    finally:
        agent.stop()


def test_a_burst_of_lease_lists_costs_one_plan(tmp_path: Path) -> None:
    agent = AgentHarness(tmp_path)
    try:
        agent.writer.acquire_first()
        leases, revision = agent.manager.list_leases()
        replans = 0
        replan = agent.writer.planner.replan

        def counting() -> None:
            nonlocal replans
            replans += 1
            replan()

        agent.writer.planner.replan = counting  # type: ignore[method-assign]
        burst: list[Event] = [LeasesChanged(leases, revision + i) for i in range(50)]
        tick = Tick("renew")
        for event in burst[:25]:
            agent.put(event)
        agent.put(tick)
        for event in burst[25:]:
            agent.put(event)
        events = agent.writer.take_queued(agent.writer.queue.get_nowait())
        assert events == [tick, burst[-1]]  # the newest list stands for the others, in order
        for event in events:
            agent.writer.handle(event, settle=False)
        assert replans == 1
        assert agent.writer.counts.events()["leases"] == 50  # every one counted as handled
    finally:
        agent.stop()


# --- the reconciler: a pass for a new plan reads the kernel only when it must ---------------


def test_a_pass_for_a_new_plan_leaves_the_kernel_as_a_pass_that_dumps_would() -> None:
    rnd = random.Random(5)
    ctx = context("vxlan", direct_routing=True)
    backend = get_backend("vxlan")
    own = [own_lease(1, False, ctx)]
    kernel = FakeKernel()
    reconciler = Reconciler(kernel, 10.0)
    memo = PlanMemo()
    kept_views = counted_views = 0
    for i, leases in enumerate(steps(rnd, False, 60)):
        bounds = node_bounds(ctx, own, [])
        peers = list(split_peers({x.key: x for x in leases.values()}, [], bounds)[0].values())
        want = backend.plan(ctx, own, peers, rnd.choice([MACS[0], MACS[0], MACS[1]]), memo)
        reconciler.set_desired(want)
        reconciler.reconcile_once(PLAN_CHANGED)
        # What a dump finds now is exactly the plan: nothing left to do.
        scope = ({link.name for link in want.links}, want.owned_devices)
        dumped = kernel.observe(*scope)
        assert diff(want, dumped).empty, f"step {i}"
        # The view the pass keeps for the next one is what that dump reads, and the
        # identities it counts are that view's.
        kept = reconciler._view[1] if reconciler._view else None
        if kept is not None:
            assert (kept.routes, kept.neighbours, kept.fdb) == (
                dumped.routes,
                dumped.neighbours,
                dumped.fdb,
            ), f"step {i}"
            kept_views += 1
        counted = reconciler._identities
        if counted is not None:
            assert kept is not None and counted.distinct(kept) == Identities(kept).distinct(kept)
            counted_views += 1
    # Only a new VTEP MAC (a device change) made a pass read the kernel again.
    assert 1 < reconciler.dumps < 40
    assert kept_views >= 20 and counted_views >= 5  # both were compared, many times


def _count_identities(monkeypatch: pytest.MonkeyPatch, name: str) -> list[int]:
    """How many entries each call of the diff's identity function ``name`` is given, as
    the calls come."""
    walked: list[int] = []
    real = getattr(diff_module, name)

    def counting(entries: Iterable[Route | Neighbour]) -> list[Hashable]:
        found: list[Hashable] = real(entries)
        walked.append(len(found))
        return found

    monkeypatch.setattr(diff_module, name, counting)
    return walked


def test_a_pass_that_deletes_walks_the_entries_only_after_a_dump(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """To delete a route by its destination, a pass must know no other route has it. The
    first deletion after a dump learns it from every entry; the passes after it keep
    that count by what they change, and a deletion then walks the deleted entries alone,
    until a dump (another tool's change) is counted anew."""
    ctx = context("vxlan")
    own = [own_lease(1, False, ctx)]
    peers = [lease(f"10.244.{n}.0/24", f"192.168.1.{n + 20}", mac=MACS[n]) for n in range(2, 30)]
    kernel = FakeKernel()
    reconciler = Reconciler(kernel, 10.0)
    walked = _count_identities(monkeypatch, "_route_ids")

    def plan(peers: list[Lease]) -> None:
        reconciler.set_desired(get_backend("vxlan").plan(ctx, own, peers, MACS[0]))
        reconciler.reconcile_once(PLAN_CHANGED)
        assert {r.dst for r in kernel.state.routes} == {p.subnet for p in peers}

    plan(peers)
    plan(peers)  # the device's MAC read back: the view is known from now on
    plan(peers[:-1])
    assert max(walked) == len(peers)  # the first deletion: every route's identity
    for n in range(2, 6):
        walked.clear()
        plan(peers[: -n - 1] + peers[-n:])  # one in, one out
        assert walked and max(walked) <= 1, walked
    kernel.state = replace(kernel.state, routes=frozenset(list(kernel.state.routes)[1:]))
    reconciler.reconcile_once("route")  # another tool deleted one: dumped, repaired
    walked.clear()
    held = len(kernel.state.routes)
    plan(peers[:-8])
    assert max(walked) == held  # counted anew after the dump
    assert reconciler.dumps == 3
    # A peer's new VTEP MAC replaces its neighbour (the same identity): after a dump, the
    # first such pass looks at every neighbour, the next ones at the replaced alone.
    neighbours_walked = _count_identities(monkeypatch, "_neigh_ids")
    kernel.state = replace(kernel.state, routes=frozenset(list(kernel.state.routes)[1:]))
    reconciler.reconcile_once("route")  # dumped again
    current = peers[:-8]
    for step, mac in enumerate(MACS[30:34]):
        neighbours_walked.clear()
        current = [lease(str(current[0].subnet), "192.168.1.22", mac=mac), *current[1:]]
        plan(current)
        assert any(n.mac == mac for n in kernel.state.neighbours)
        assert max(neighbours_walked) == (len(current) if step == 0 else 1), neighbours_walked


def test_a_change_by_another_tool_or_a_failed_pass_is_read_back_from_the_kernel() -> None:
    ctx = context("vxlan")
    own = [own_lease(1, False, ctx)]
    peers = [lease(f"10.244.{n}.0/24", f"192.168.1.{n + 20}", mac=MACS[n]) for n in range(2, 8)]
    kernel = FakeKernel()
    reconciler = Reconciler(kernel, 10.0)
    for n in (2, 3, 4):
        reconciler.set_desired(get_backend("vxlan").plan(ctx, own, peers[:n], MACS[0]))
        reconciler.reconcile_once(PLAN_CHANGED)
    # The first pass made the device (whose MAC the kernel reports), the second read it
    # back, the third knew the kernel from the second.
    assert reconciler.dumps == 2 and len(kernel.state.routes) == 4
    # Someone deletes a route: the netlink event's pass reads the kernel and repairs it.
    kernel.state = replace(kernel.state, routes=frozenset(list(kernel.state.routes)[1:]))
    reconciler.reconcile_once("route")
    assert reconciler.dumps == 3 and len(kernel.state.routes) == 4
    # A pass whose routes failed leaves no view: the next one reads the kernel again.
    kernel.fail_next_routes = True
    reconciler.set_desired(get_backend("vxlan").plan(ctx, own, peers[:5], MACS[0]))
    reconciler.reconcile_once(PLAN_CHANGED)
    assert len(kernel.state.routes) == 4
    reconciler.set_desired(get_backend("vxlan").plan(ctx, own, peers[:6], MACS[0]))
    reconciler.reconcile_once(PLAN_CHANGED)
    assert reconciler.dumps == 4 and len(kernel.state.routes) == 6


def test_the_timer_reads_the_kernel_back_once_per_full_dump_interval() -> None:
    """A periodic pass within FULL_DUMP_SECONDS of a dump trusts the view the last pass
    left (notifications report the rest); a later one reads the kernel and repairs what
    no notification reports: a neighbour rewritten in place. A kernel event always dumps."""
    clock = [1000.0]
    ctx = context("vxlan")
    own = [own_lease(1, False, ctx)]
    peers = [lease(f"10.244.{n}.0/24", f"192.168.1.{n + 20}", mac=MACS[n]) for n in range(2, 5)]
    kernel = FakeKernel()
    reconciler = Reconciler(kernel, 10.0, monotonic=lambda: clock[0])
    reconciler.set_desired(get_backend("vxlan").plan(ctx, own, peers, MACS[0]))
    reconciler.reconcile_once(PERIODIC)  # makes the device: no view kept
    reconciler.reconcile_once(PERIODIC)  # reads it back
    assert reconciler.dumps == 2
    wanted = kernel.state.neighbours
    first = sorted(wanted, key=str)[0]
    kernel.state = replace(
        kernel.state, neighbours=wanted - {first} | {replace(first, mac=MACS[7])}
    )
    clock[0] += FULL_DUMP_SECONDS / 2
    reconciler.reconcile_once(PERIODIC)
    assert reconciler.dumps == 2 and kernel.state.neighbours != wanted  # not seen yet
    clock[0] += FULL_DUMP_SECONDS / 2
    reconciler.reconcile_once(PERIODIC)
    assert reconciler.dumps == 3 and kernel.state.neighbours == wanted  # repaired
    reconciler.reconcile_once("neighbour")
    assert reconciler.dumps == 4


def test_a_timers_pass_between_dumps_does_not_compare_the_same_plan_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Between dumps, a timer's pass with the plan and the view of the pass before has
    nothing new to compare (the diff is a function of those two); a new plan, a dump or a
    kernel event is compared, and repaired, as before."""
    clock = [1000.0]
    ctx = context("vxlan")
    own = [own_lease(1, False, ctx)]
    peers = [lease(f"10.244.{n}.0/24", f"192.168.1.{n + 20}", mac=MACS[n]) for n in range(2, 6)]
    kernel = FakeKernel()
    reconciler = Reconciler(kernel, 10.0, monotonic=lambda: clock[0])
    reconciler.set_desired(get_backend("vxlan").plan(ctx, own, peers[:3], MACS[0]))
    reconciler.reconcile_once(PERIODIC)  # makes the device
    reconciler.reconcile_once(PERIODIC)  # reads it back
    compared: list[int] = []
    real_diff = reconciler_module.diff

    def counting(
        desired: DesiredState, observed: ObservedState, identities: Identities | None = None
    ) -> Changes:
        compared.append(len(desired.routes))
        return real_diff(desired, observed, identities)

    monkeypatch.setattr(reconciler_module, "diff", counting)
    for _ in range(5):
        clock[0] += 10.0
        assert reconciler.reconcile_once(PERIODIC).changes.empty  # type: ignore[union-attr]
    assert compared == [3] and reconciler.dumps == 2  # the first of them only
    reconciler.set_desired(get_backend("vxlan").plan(ctx, own, peers, MACS[0]))
    reconciler.reconcile_once(PLAN_CHANGED)
    assert compared == [3, 4] and len(kernel.state.routes) == 4
    kernel.state = replace(kernel.state, routes=frozenset(list(kernel.state.routes)[1:]))
    reconciler.reconcile_once("route")  # another tool deleted one: read back, repaired
    assert compared == [3, 4, 4] and len(kernel.state.routes) == 4
    clock[0] += FULL_DUMP_SECONDS
    reconciler.reconcile_once(PERIODIC)  # the minute's dump is compared again
    assert compared == [3, 4, 4, 4] and reconciler.dumps == 4


# --- status.json: each probe result is rendered once -----------------------------------------


class Results:
    """What ``ProbesJson`` reads of the prober: its latest result per peer."""

    def __init__(self) -> None:
        self.latest: dict[str, ProbeResult] = {}

    def results(self) -> dict[str, ProbeResult]:
        return dict(self.latest)


def test_the_status_file_renders_only_the_probe_results_that_changed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    prober = Results()
    for n in range(50):
        prober.latest[f"10.244.{n}.0/24"] = ProbeResult(True, 0.001 * n, 0.0, True, None, n)
    rendered: list[ProbeResult] = []
    as_status = ProbeResult.as_status

    def counting(self: ProbeResult) -> dict[str, object]:
        rendered.append(self)
        return as_status(self)

    monkeypatch.setattr(ProbeResult, "as_status", counting)
    probes = ProbesJson()
    doc = json.loads(probes.splice('{"node":"n1"}', prober))  # type: ignore[arg-type]
    assert doc["node"] == "n1" and len(rendered) == 50
    assert doc["probes"] == {k: as_status(r) for k, r in prober.latest.items()}
    rendered.clear()
    prober.latest["10.244.7.0/24"] = ProbeResult(False, None, 0.5, None, "no answer", 8)
    del prober.latest["10.244.9.0/24"]
    doc = json.loads(probes.splice('{"node":"n1"}', prober))  # type: ignore[arg-type]
    assert rendered == [prober.latest["10.244.7.0/24"]]  # the one new round alone
    assert doc["probes"] == {k: as_status(r) for k, r in prober.latest.items()}
    assert json.loads(ProbesJson().splice('{"node":"n1"}', None)) == {"node": "n1", "probes": {}}


def test_a_peer_without_an_mtu_is_said_once_whatever_else_changes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    agent = AgentHarness(tmp_path)
    agent.writer.acquire_first()
    # Ten peers on subnets the agent did not take (it picks its own at random).
    own = {str(subnet) for subnet in agent.own_subnets()}
    octets = [n for n in range(2, 30) if f"10.244.{n}.0/24" not in own][:10]
    flanneld = [
        lease(f"10.244.{n}.0/24", f"192.168.1.{n + 20}", mac=MACS[n], mtu=None) for n in octets
    ]

    def put(*peers: Lease) -> None:
        for peer in peers:
            key = f"/coreos.com/network/subnets/{peer.key}"
            agent.store.put(key, peer.attrs.to_json().encode())
        agent.deliver_leases()

    def said() -> list[str]:
        # This test's writer runs in this thread; another test's agent still stopping in
        # the same worker may log too, and caplog hears every thread.
        lines = [
            r.getMessage()
            for r in caplog.records
            if "MTU unknown" in r.getMessage() and r.thread == threading.get_ident()
        ]
        caplog.clear()
        return lines

    try:
        caplog.set_level("INFO", "flannelpy.agent.planning")
        put(*flanneld[:6])
        (line,) = said()
        first, second = flanneld[0].subnet, flanneld[1].subnet
        assert line.startswith(f"MTU unknown for 6 peers ({first}, {second}, ")
        put(flanneld[6])
        seventh = flanneld[6]
        assert said() == [
            f"MTU unknown: peer {seventh.subnet} ({seventh.attrs.public_ip}) {ADVERTISES}"
        ]
        moved = replace(
            flanneld[0],
            attrs=replace(flanneld[0].attrs, backend_data={"VNI": 1, "VtepMAC": MACS[30]}),
        )
        put(moved)  # the same peer, still without an MTU: nothing more to say
        agent.deliver_leases()
        assert said() == []
    finally:
        agent.stop()


ADVERTISES = (
    "advertises no overlay MTU (flanneld or an older flannelpy), so only the prober's "
    "full-size DF probe can verify that path"
)


def test_the_memo_drops_what_a_call_lacks_even_with_a_lease_passed_twice() -> None:
    """Kept and held change in place: a call lacking a lease drops it, whatever the
    number of leases passed (the same lease twice is computed once)."""
    ctx = context("vxlan")
    rnd = random.Random(2)
    a, b = (random_lease(rnd, n, False) for n in (2, 3))
    memo: LeaseMemo[str] = LeaseMemo()
    computed: list[Lease] = []

    def compute(lease: Lease) -> str:
        computed.append(lease)
        return str(lease.ipv4_subnet)

    memo.update(ctx, [a, b], compute)
    delta = memo.update(ctx, [a, a], compute)
    assert delta.results == [str(a.ipv4_subnet)] * 2
    assert delta.dropped == [str(b.ipv4_subnet)] and delta.added == []
    delta = memo.update(ctx, [b, b, a], compute)
    assert computed == [a, b, b], "b again, once"
    assert delta.added == [str(b.ipv4_subnet)] and delta.dropped == []
