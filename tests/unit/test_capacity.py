"""Warm capacity (issue 7, field-notes §2/§3): settings, the pure plan, and the
§2 incident replayed through NodeIpam with a fake clock."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from ipaddress import IPv4Address, IPv4Network
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from flannelpy.errors import ConfigError
from flannelpy.ipam import NodeIpam
from flannelpy.ipam.capacity import (
    CapacitySettings,
    LeaseUsage,
    free_addresses,
    parse_capacity,
    plan_capacity,
    update_empty_since,
)
from flannelpy.ipam.errors import IpamExhausted
from flannelpy.ipam.store import pool_file_name

T0 = 1_700_000_000.0
A = IPv4Network("10.244.1.0/24")
B = IPv4Network("10.244.2.0/24")
C = IPv4Network("10.244.3.0/24")
D = IPv4Network("10.250.7.0/24")


def use(
    subnet: IPv4Network, assigned: int = 0, cooling: int = 0, serving: bool = True, total: int = 253
) -> LeaseUsage:
    return LeaseUsage(subnet, total, assigned, cooling, total - assigned - cooling, serving)


# --- settings --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("doc", "expected"),
    [
        ({}, CapacitySettings(0, 1, 300.0)),
        ({"Network": "10.244.0.0/16"}, CapacitySettings()),
        ({"MinFreeAddresses": 64, "MaxLeasesPerNode": 2}, CapacitySettings(64, 2, 300.0)),
        # keys are matched case-insensitively, as Flannel's Go decoder does
        (
            {"minfreeaddresses": 8, "MAXLEASESPERNODE": 3, "leaseholddownseconds": 1.5},
            CapacitySettings(8, 3, 1.5),
        ),
        ({"MinFreeAddresses": None, "LeaseHoldDownSeconds": None}, CapacitySettings()),
        ({"LeaseHoldDownSeconds": 0}, CapacitySettings(hold_down_seconds=0)),
        ({"MaxLeasesPerNode": 4}, CapacitySettings(0, 4, 300.0)),
    ],
)
def test_parse_capacity(doc: dict[str, Any], expected: CapacitySettings) -> None:
    assert parse_capacity(doc) == expected
    assert parse_capacity(doc).enabled == (expected.min_free_addresses > 0)


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        (
            {"MinFreeAddresses": -1, "MaxLeasesPerNode": 2},
            '"MinFreeAddresses" must be a whole number >= 0, not -1; '
            'write it like "MinFreeAddresses": 64',
        ),
        (
            {"MinFreeAddresses": 6.5, "MaxLeasesPerNode": 2},
            '"MinFreeAddresses" must be a whole number >= 0, not 6.5',
        ),
        (
            {"MinFreeAddresses": "64", "MaxLeasesPerNode": 2},
            '"MinFreeAddresses" must be a whole number >= 0, not "64"',
        ),
        ({"MaxLeasesPerNode": 0}, '"MaxLeasesPerNode" must be a whole number >= 1, not 0'),
        ({"MaxLeasesPerNode": True}, '"MaxLeasesPerNode" must be a whole number >= 1, not true'),
        (
            {"LeaseHoldDownSeconds": -5},
            '"LeaseHoldDownSeconds" must be a number of seconds >= 0, not -5',
        ),
        (
            {"LeaseHoldDownSeconds": float("inf")},
            '"LeaseHoldDownSeconds" must be a number of seconds >= 0, not inf',
        ),
        (
            {"LeaseHoldDownSeconds": "5m"},
            '"LeaseHoldDownSeconds" must be a number of seconds >= 0, not "5m"',
        ),
        # a warm target that could never be met is refused, not silently ignored
        (
            {"MinFreeAddresses": 64},
            '"MinFreeAddresses" is 64 but "MaxLeasesPerNode" is 1, so no further lease could '
            'ever be acquired; set "MaxLeasesPerNode" to 2 or more, or remove "MinFreeAddresses"',
        ),
        (
            {"MinFreeAddresses": 1, "minFreeAddresses": 2},
            'keys "MinFreeAddresses" and "minFreeAddresses" differ only in case',
        ),
    ],
)
def test_parse_capacity_refuses_with_one_sentence(doc: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_capacity(doc)
    text = str(caught.value)
    assert text.startswith("net-conf.json: ")
    assert message in text
    assert ". " not in text  # one sentence


# --- the plan, table-driven --------------------------------------------------------

WARM = CapacitySettings(min_free_addresses=64, max_leases_per_node=2, hold_down_seconds=300)
WIDE = CapacitySettings(min_free_addresses=64, max_leases_per_node=4, hold_down_seconds=300)
OFF = CapacitySettings(min_free_addresses=0, max_leases_per_node=3, hold_down_seconds=300)
LONG_EMPTY = T0 - 300  # empty for exactly the hold-down period


@pytest.mark.parametrize(
    ("leases", "settings", "empty_since", "acquire", "release", "reason"),
    [
        # warm capacity off, one busy lease: nothing
        ([use(A, 200)], CapacitySettings(), {}, False, (), "53 free addresses on 1 serving"),
        # §2's numbers: /24 (253), 110 assigned, 80 cooling: 63 free < 64 -> ask now
        (
            [use(A, 110, 80)],
            WARM,
            {},
            True,
            (),
            "63 free addresses < MinFreeAddresses 64: acquire lease 2 of at most 2",
        ),
        # exactly at the target: enough
        ([use(A, 110, 79)], WARM, {}, False, (), "64 free addresses"),
        # cooling is never free: 143 "available" if it were, 43 truly
        ([use(A, 110, 100)], WARM, {}, True, (), "43 free addresses"),
        # at the limit: say so, ask for nothing
        (
            [use(A, 230), use(B, 230)],
            WARM,
            {},
            False,
            (),
            "but the node holds 2 leases, the MaxLeasesPerNode limit",
        ),
        # a draining lease's room does not count: 53 free, though A has 243 unused
        ([use(A, 10, serving=False), use(B, 200)], WIDE, {}, True, (), "53 free addresses"),
        # a drained lease goes as soon as it is empty, without a hold-down
        (
            [use(A, serving=False), use(B, 10)],
            WARM,
            {},
            False,
            (A,),
            "10.244.1.0/24 is draining and empty: release it",
        ),
        # ... and not while it has pods or cooling addresses
        ([use(A, 1, serving=False), use(B, 10)], WARM, {}, False, (), "nothing to do"),
        ([use(A, 0, 1, serving=False), use(B, 10)], WARM, {}, False, (), "nothing to do"),
        # the only lease drains (its pool tagged 0): ask for one despite MaxLeasesPerNode 1
        ([use(A, 40, serving=False)], CapacitySettings(), {}, True, (), "no serving lease"),
        ([], CapacitySettings(), {}, True, (), "no serving lease"),
        # releasing the drained one makes room under the limit for the new one
        ([use(A, serving=False), use(B, 240)], WARM, {}, True, (A,), "acquire lease 2"),
        # surplus: empty for the hold-down, and A alone keeps 143 >= 64
        (
            [use(A, 110), use(B)],
            WARM,
            {B: LONG_EMPTY},
            False,
            (B,),
            "10.244.2.0/24 has been "
            "empty for 300 s and the node keeps 143 free addresses without it: release it",
        ),
        ([use(A, 110), use(B)], WARM, {B: LONG_EMPTY + 1}, False, (), "nothing to do"),
        ([use(A, 110), use(B)], WARM, {}, False, (), "nothing to do"),  # hold-down not started
        # surplus but needed: without B only 50 would be free
        ([use(A, 203), use(B)], WARM, {B: LONG_EMPTY}, False, (), "nothing to do"),
        # B has a cooling address: never released
        ([use(A, 10), use(B, 0, 1)], WARM, {B: LONG_EMPTY}, False, (), "nothing to do"),
        # never the first lease, even empty and surplus
        ([use(A), use(B, 10)], OFF, {A: LONG_EMPTY}, False, (), "nothing to do"),
        # never the last serving lease
        ([use(A, 10, serving=False), use(B)], OFF, {B: LONG_EMPTY}, False, (), "nothing to do"),
        # two surplus: newest first, as long as the rest keeps the target
        (
            [use(A, 100), use(B), use(C)],
            WIDE,
            {B: LONG_EMPTY, C: LONG_EMPTY},
            False,
            (C, B),
            "keeps 406 free",
        ),
        (
            [use(A, 100), use(B), use(C)],
            CapacitySettings(200, 4, 300),
            {B: LONG_EMPTY, C: LONG_EMPTY},
            False,
            (C,),
            "keeps 406 free",
        ),
    ],
)
def test_plan(
    leases: list[LeaseUsage],
    settings: CapacitySettings,
    empty_since: Mapping[IPv4Network, float],
    acquire: bool,
    release: tuple[IPv4Network, ...],
    reason: str,
) -> None:
    plan = plan_capacity(leases, settings, T0, empty_since)
    assert (plan.acquire, plan.release) == (acquire, release)
    assert reason in plan.reason


def test_update_empty_since_keeps_the_first_time_seen_empty() -> None:
    first = update_empty_since([use(A, 5), use(B), use(C, 0, 2)], {}, T0)
    assert first == {B: T0}
    later = update_empty_since([use(A), use(B), use(C, 0, 2)], first, T0 + 60)
    assert later == {A: T0 + 60, B: T0}
    # B got a pod, D is no longer held: both drop out
    again = update_empty_since([use(A), use(B, 1)], {**later, D: T0}, T0 + 90)
    assert again == {A: T0 + 60}


# --- the plan's invariants over arbitrary usage ------------------------------------

SUBNETS = [IPv4Network(f"10.244.{i}.0/24") for i in range(1, 7)]


@st.composite
def situations(
    draw: st.DrawFn,
) -> tuple[list[LeaseUsage], CapacitySettings, dict[IPv4Network, float]]:
    n = draw(st.integers(0, 5))
    leases = []
    for subnet in SUBNETS[:n]:
        assigned = draw(st.sampled_from([0, 0, 1, 100, 253]))
        cooling = draw(st.sampled_from([0, 0, 1, 253 - assigned]))
        leases.append(use(subnet, assigned, min(cooling, 253 - assigned), draw(st.booleans())))
    min_free = draw(st.sampled_from([0, 1, 64, 253, 300, 600]))
    max_leases = draw(st.integers(2 if min_free else 1, 6))
    settings = CapacitySettings(min_free, max_leases, draw(st.sampled_from([0.0, 300.0])))
    since = {
        lease.subnet: T0 - draw(st.sampled_from([0, 10, 300, 1000]))
        for lease in leases
        if lease.empty and draw(st.booleans())
    }
    return leases, settings, since


@given(situations())
def test_plan_invariants(
    situation: tuple[list[LeaseUsage], CapacitySettings, dict[IPv4Network, float]],
) -> None:
    leases, settings, since = situation
    plan = plan_capacity(leases, settings, T0, since)
    by_subnet = {lease.subnet: lease for lease in leases}
    released = [by_subnet[s] for s in plan.release]
    assert len(set(plan.release)) == len(plan.release)
    # Never a lease with an assigned or cooling address.
    assert all(lease.empty for lease in released)
    # Every empty drained lease goes; a serving one only after its hold-down,
    # never the first lease, never the last serving one, never below the target.
    assert {lease.subnet for lease in released if not lease.allocatable} == {
        lease.subnet for lease in leases if lease.empty and not lease.allocatable
    }
    serving_released = [lease for lease in released if lease.allocatable]
    for lease in serving_released:
        assert lease.subnet != leases[0].subnet
        assert T0 - since[lease.subnet] >= settings.hold_down_seconds
    kept = [lease for lease in leases if lease.subnet not in plan.release]
    serving_before = [lease for lease in leases if lease.allocatable]
    if serving_before:
        assert any(lease.allocatable for lease in kept)
    if serving_released:
        assert free_addresses(kept) >= settings.min_free_addresses
    # Acquire exactly when the node cannot serve, or is short and under the limit.
    short = free_addresses(leases) < settings.min_free_addresses
    assert plan.acquire == (
        not serving_before or (short and len(kept) < settings.max_leases_per_node)
    )
    # Doing what the plan says leads to a plan that asks for nothing new: no flapping.
    again = plan_capacity(kept, settings, T0, since)
    assert again.release == ()
    if not plan.acquire:
        assert not again.acquire


# --- §2's incident through NodeIpam: churn on a /24 with a 30 s cooldown -----------


@dataclass
class SimAgent:
    """The agent's capacity side on a fake clock: it plans when NodeIpam's low-free
    callback wakes it (``react``) and/or every ``period`` seconds; a lease it asks
    for becomes usable ``latency`` seconds later (the store round trip)."""

    node: NodeIpam
    settings: CapacitySettings
    spares: list[IPv4Network]
    latency: float
    react: bool = True
    period: float | None = None
    leases: list[IPv4Network] = field(default_factory=lambda: [A])
    requests: list[tuple[float, int]] = field(default_factory=list)  # (time, free then)
    arrivals: list[tuple[float, IPv4Network]] = field(default_factory=list)
    released: list[tuple[float, IPv4Network]] = field(default_factory=list)
    empty_since: dict[IPv4Network, float] = field(default_factory=dict)
    _woken: bool = False
    _arriving: tuple[float, IPv4Network] | None = None
    _next_tick: float = T0

    def __post_init__(self) -> None:
        self.node.set_leases(self.leases)
        if self.react:
            self.node.set_low_free_watch(self.settings.min_free_addresses, self._wake)

    def _wake(self, free: int) -> None:
        self._woken = True  # what the real callback does: set an event, nothing else

    def tick(self, now: float) -> None:
        if self._arriving is not None and now >= self._arriving[0]:
            subnet = self._arriving[1]
            self._arriving = None
            self.leases.append(subnet)
            self.node.set_leases(self.leases)
            self.arrivals.append((now, subnet))
        periodic = self.period is not None and now >= self._next_tick
        if periodic:
            assert self.period is not None
            while self._next_tick <= now:
                self._next_tick += self.period
        if not (self._woken or periodic):
            return
        self._woken = False
        usage = self.node.usage()
        self.empty_since = update_empty_since(usage, self.empty_since, now)
        plan = plan_capacity(usage, self.settings, now, self.empty_since)
        if plan.acquire and self._arriving is None and self.spares:
            self.requests.append((now, free_addresses(usage)))
            self._arriving = (now + self.latency, self.spares.pop(0))
        for subnet in plan.release:
            if self.node.remove_lease_if_empty(subnet):  # first IPAM, then the store
                self.leases.remove(subnet)
                self.released.append((now, subnet))
                self.node.set_leases(self.leases)


class FakeClock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> float:
        return self.now


@dataclass
class Run:
    failures: list[float]
    lowest_free_before_arrival: int
    agent: SimAgent
    by_subnet: dict[IPv4Network, int]  # allocations made per lease
    released_at: dict[IPv4Address, float]  # last release of each address


@pytest.fixture
def node(tmp_path: Path) -> Iterator[tuple[NodeIpam, FakeClock]]:
    clock = FakeClock()
    with NodeIpam(str(tmp_path), cooldown_seconds=30, clock=clock, fsync=False) as ipam:
        yield ipam, clock


def churn(ipam: NodeIpam, clock: FakeClock, agent: SimAgent, period: float, seconds: float) -> Run:
    """110 pods, then every ``period`` s one pod ends and one is added (the kubelet
    retries a failed ADD at the next tick). The agent runs after every event."""
    released_at: dict[IPv4Address, float] = {}
    failures: list[float] = []
    by_subnet: dict[IPv4Network, int] = {}
    lowest = 253
    pods: deque[str] = deque()
    pending: deque[str] = deque(f"p{i}" for i in range(110))
    serial = 110
    end = clock.now + seconds
    while clock.now < end:
        while pending:
            try:
                a = ipam.allocate(pending[0], "eth0")
            except IpamExhausted:
                failures.append(clock.now)
                agent.tick(clock.now)
                break
            last = released_at.get(a.ip)
            assert last is None or a.assigned_at - last >= 30, f"{a.ip} reused in cooldown"
            by_subnet[a.subnet] = by_subnet.get(a.subnet, 0) + 1
            pods.append(pending.popleft())
            agent.tick(clock.now)
            if not agent.arrivals:
                lowest = min(lowest, free_addresses(ipam.usage()))
        clock.now += period
        gone = ipam.release(pods.popleft(), "eth0")
        assert gone is not None
        released_at[gone.ip] = clock.now
        pending.append(f"p{serial}")
        serial += 1
        agent.tick(clock.now)
    return Run(failures, lowest, agent, by_subnet, released_at)


# 200 pods end and 200 start per 30 s: 110 + 200 addresses are assigned or
# cooling at once, more than a /24's 253, so one lease cannot carry it.
CHURN_PERIOD = 30 / 200


@pytest.mark.parametrize(
    ("min_free", "react", "period", "latency", "fails"),
    [
        # the case: a second lease is asked for at the first ADD below 64
        (64, True, None, 1.0, False),
        # a small warm target still suffices when the ADD itself wakes the agent
        (8, True, None, 0.3, False),
        # §2's incident: the same target with a 5 s refill loop loses the race
        (8, False, 5.0, 0.3, True),
        # warm capacity off: the /24 runs dry
        (0, True, None, 1.0, True),
    ],
)
def test_churn_on_a_busy_node(
    node: tuple[NodeIpam, FakeClock],
    min_free: int,
    react: bool,
    period: float | None,
    latency: float,
    fails: bool,
) -> None:
    ipam, clock = node
    settings = CapacitySettings(min_free, 2, 300)
    agent = SimAgent(ipam, settings, [B], latency, react=react, period=period)
    run = churn(ipam, clock, agent, CHURN_PERIOD, seconds=120)
    assert bool(run.failures) == fails
    if fails:
        return
    # The second lease was asked for while addresses remained, at the very ADD
    # that crossed the target, and arrived before the node ran dry.
    [(asked_at, free_then)] = agent.requests
    assert free_then == min_free - 1
    [(arrived_at, subnet)] = agent.arrivals
    assert subnet == B and arrived_at - asked_at == pytest.approx(latency, abs=CHURN_PERIOD)
    assert run.lowest_free_before_arrival > 0
    assert run.by_subnet[B] > 0  # it carried real load
    assert agent.released == []  # busy: nothing to give back
    assert [u.subnet for u in ipam.usage()] == [A, B]


def test_surplus_lease_goes_back_after_the_hold_down(
    node: tuple[NodeIpam, FakeClock], tmp_path: Path
) -> None:
    ipam, clock = node
    agent = SimAgent(ipam, CapacitySettings(64, 2, 300), [B], 1.0, period=10.0)
    run = churn(ipam, clock, agent, CHURN_PERIOD, seconds=60)
    assert run.failures == [] and [s for _, s in agent.arrivals] == [B]
    assert run.by_subnet[B] > 0
    # The burst is over: the pods still on B end; the rest stay on A.
    for a in ipam.allocations():
        if a.subnet == B:
            ipam.release(a.container_id, a.ifname)
            run.released_at[a.ip] = clock.now
    # B is empty once its last released address has cooled down.
    empty_at = max(t for ip, t in run.released_at.items() if ip in B) + 30
    assert not ipam.is_empty(B)
    while clock.now < empty_at + 400 and not agent.released:
        clock.now += 1
        agent.tick(clock.now)
    [(released_at, subnet)] = agent.released
    assert subnet == B
    # Empty for the 300 s hold-down, as seen by the agent's 10 s ticks.
    assert empty_at + 300 <= released_at <= empty_at + 300 + 10
    assert [u.subnet for u in ipam.usage()] == [A]
    assert not (tmp_path / pool_file_name(B)).exists()
    assert free_addresses(ipam.usage()) >= 64
