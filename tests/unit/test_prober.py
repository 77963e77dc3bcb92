"""The prober's pure parts: scheduling, phase spreading, windowed statistics, verdicts,
the IPv6 side of dual-stack peers (sources, sizes, budget, ICMPv6 matching).

A fake clock and a fake transport that models a network: per-target reachability,
a path that silently drops packets over some size, a local route MTU that makes
the kernel refuse (EMSGSIZE), and a deterministic loss pattern.
"""

from __future__ import annotations

import errno
import itertools
import json
import math
import random
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from ipaddress import IPv4Address, IPv4Network, IPv6Address, IPv6Network

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flannelpy.agent.planning import ProbeEntries, probe_entries, probe_peers, probe_source6
from flannelpy.backend.base import NodeContext
from flannelpy.config.netconf import parse_network_config
from flannelpy.dataplane.icmp import (
    Icmp6Transport,
    Reply,
    echo6_request,
    echo_request,
    icmp_checksum,
)
from flannelpy.dataplane.state import UnderlayInterface
from flannelpy.errors import ConfigError
from flannelpy.observe import prober as prober_module
from flannelpy.observe.probe_rounds import SMALL_PROBE_BYTES, SMALL_PROBE_BYTES6
from flannelpy.observe.probe_schedule import (
    cycle_after,
    cycle_seconds,
    first_slot,
    next_slot,
    phase_seconds,
    slot_after,
)
from flannelpy.observe.probe_verdict import (
    ProbeResult,
    RoundOutcome,
    mtu_verdict,
    needs_confirmation,
    summarize,
)
from flannelpy.observe.prober import Prober
from flannelpy.subnet.lease import Lease, LeaseAttrs
from flannelpy.subnet.memo import LeaseMemo
from tests.support.waiting import wait_until

T0 = 1_700_000_000.0
OWN = IPv4Address("10.244.1.0")
MTU = 1450


class FakeClock:
    def __init__(self, t: float = T0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


@dataclass
class Sent:
    at: float
    source: IPv4Address
    target: IPv4Address
    size: int
    ticket: int


@dataclass
class FakeNet:
    """A transport whose answers follow a model of the network, timed on the fake clock."""

    clock: FakeClock
    rtt: float = 0.002
    down: set[IPv4Address] = field(default_factory=set)
    path_mtu: dict[IPv4Address, int] = field(default_factory=dict)  # silent drop above
    local_mtu: int | None = None  # EMSGSIZE above
    drop_small: Callable[[IPv4Address, int], bool] = lambda target, n: False
    icmp_error: dict[IPv4Address, Reply] = field(default_factory=dict)
    sent: list[Sent] = field(default_factory=list)
    cancelled: set[int] = field(default_factory=set)
    answered: set[int] = field(default_factory=set)
    max_outstanding: int = 0
    _due: list[tuple[float, Reply]] = field(default_factory=list)
    _small_count: Counter[IPv4Address] = field(default_factory=Counter)

    def send(self, source: IPv4Address, target: IPv4Address, size: int) -> int:
        if self.local_mtu is not None and size > self.local_mtu:
            raise OSError(errno.EMSGSIZE, "Message too long")
        ticket = len(self.sent) + 1
        self.sent.append(Sent(self.clock(), source, target, size, ticket))
        self.max_outstanding = max(self.max_outstanding, self.outstanding())
        if target in self.icmp_error:
            self._due.append(
                (self.clock() + self.rtt, self.icmp_error[target]._replace(ticket=ticket))
            )
            return ticket
        if target in self.down or size > self.path_mtu.get(target, 65535):
            return ticket
        if size == SMALL_PROBE_BYTES:
            self._small_count[target] += 1
            if self.drop_small(target, self._small_count[target]):
                return ticket
        self._due.append((self.clock() + self.rtt, Reply(ticket, self.rtt)))
        return ticket

    def take_replies(self) -> list[Reply]:
        now = self.clock()
        ready = [r for at, r in self._due if at <= now and r.ticket not in self.cancelled]
        self._due = [(at, r) for at, r in self._due if at > now]
        self.answered |= {r.ticket for r in ready}
        return ready

    def cancel(self, ticket: int) -> None:
        self.cancelled.add(ticket)

    def outstanding(self) -> int:
        return len(self.sent) - len(self.cancelled) - len(self.answered)

    def small_sends(self, target: IPv4Address | None = None) -> list[Sent]:
        return [
            s
            for s in self.sent
            if s.size == SMALL_PROBE_BYTES and (target is None or s.target == target)
        ]


def peer_ip(i: int) -> IPv4Address:
    return IPv4Address("10.244.0.0") + 256 * (i + 2)


def make(
    n_peers: int = 1,
    *,
    mtu: int | None = MTU,
    own: IPv4Address | None = OWN,
    **kwargs: object,
) -> tuple[Prober, FakeNet, FakeClock, list[tuple[str, ProbeResult]]]:
    clock = FakeClock()
    net = FakeNet(clock)
    seen: list[tuple[str, ProbeResult]] = []
    options: dict = {"interval_seconds": 5.0, "timeout_seconds": 1.0, **kwargs}
    prober = Prober(
        net,
        clock,
        mtu_provider=lambda: mtu,
        own_address_provider=lambda: own,
        on_results=seen.extend,
        **options,
    )
    prober.set_peers({f"p{i}": (peer_ip(i), f"node{i}") for i in range(n_peers)})
    return prober, net, clock, seen


def rounds(prober: Prober, clock: FakeClock, n: int, key: str = "p0") -> ProbeResult:
    """Tick as the prober asks until ``key`` has completed ``n`` more rounds."""
    start = prober.results()[key].probes if key in prober.results() else 0
    for _ in range(10_000):
        result = prober.results().get(key)
        if result is not None and result.probes >= start + n:
            assert result.probes == start + n
            return result
        clock.t = max(prober.tick(), clock.t)
    raise AssertionError(f"{key} did not complete {n} rounds")


def advance(prober: Prober, clock: FakeClock, seconds: float) -> None:
    """Tick exactly at every time the prober asks for, up to now + seconds."""
    until = clock.t + seconds
    while True:
        wake = prober.tick()
        if wake > until:
            clock.t = until
            prober.tick()
            return
        clock.t = max(wake, clock.t)


# --- statistics (table-driven) ----------------------------------------------------

OK = RoundOutcome(True, 0.001, "answered")
LOST = RoundOutcome(False, None, "lost", "timeout")  # small and big both lost
STRIKE = RoundOutcome(True, 0.001, "lost", "big lost")  # small answered, big not
REFUSED = RoundOutcome(True, 0.001, "refused", "message too long")
SMALL_ONLY = RoundOutcome(True, 0.001, "not-sent")


@pytest.mark.parametrize(
    ("history", "expected"),
    [
        ([], None),
        ([OK], True),
        ([STRIKE], None),
        ([STRIKE, STRIKE], None),
        ([STRIKE, STRIKE, STRIKE], False),
        ([OK, STRIKE, STRIKE, STRIKE], False),
        ([STRIKE, STRIKE, STRIKE, OK], True),  # repaired: the newest evidence wins
        ([STRIKE, LOST, STRIKE, LOST, STRIKE], False),  # fully lost rounds say nothing
        ([OK, STRIKE, STRIKE], True),
        ([REFUSED], False),  # a local refusal is conclusive at once
        ([OK, REFUSED], False),
        ([SMALL_ONLY, SMALL_ONLY], None),
        ([LOST, LOST, LOST], None),
    ],
)
def test_mtu_verdict(history: list[RoundOutcome], expected: bool | None) -> None:
    assert mtu_verdict(history, strikes=3) is expected


@pytest.mark.parametrize(
    ("history", "reachable", "loss", "rtt"),
    [
        ([OK] * 4, True, 0.0, 0.001),
        ([OK, LOST, OK, LOST], True, 0.5, 0.001),
        ([OK, LOST, LOST], True, 2 / 3, 0.001),  # OK is within the last 3 rounds
        ([OK, LOST, LOST, LOST], False, 0.75, None),  # down: no RTT shown
        ([LOST, LOST, LOST, OK], True, 0.75, 0.001),
        ([RoundOutcome(False, None, "answered")] * 3, True, 1.0, None),  # big got through
        ([], False, 0.0, None),
    ],
)
def test_summarize(
    history: list[RoundOutcome], reachable: bool, loss: float, rtt: float | None
) -> None:
    result = summarize(history, probes=len(history), down_after=3)
    assert result.reachable is reachable
    assert result.loss_ratio == pytest.approx(loss)
    assert result.rtt_seconds == rtt
    assert result.probes == len(history)


def test_as_status_has_the_keys_status_json_uses() -> None:
    r = ProbeResult(True, 0.0012345, 0.25, False, "message too long", 7)
    assert r.as_status() == {
        "reachable": True,
        "rtt_ms": 1.234,
        "loss": 0.25,
        "mtu_ok": False,
        "error": "message too long",
        "probes": 7,
    }


# --- the prober against the fake network -------------------------------------------


def test_healthy_peer() -> None:
    prober, net, clock, seen = make()
    result = rounds(prober, clock, 3)
    assert result.reachable and result.mtu_ok is True and result.last_error is None
    assert result.rtt_seconds == pytest.approx(0.002)
    assert result.loss_ratio == 0.0
    assert result.label == "node0" and result.target == peer_ip(0)
    # each round: one small echo and one echo of exactly the overlay MTU, from our address
    assert sorted(s.size for s in net.sent) == sorted([SMALL_PROBE_BYTES, MTU] * result.probes)
    assert {s.source for s in net.sent} == {OWN}
    assert [key for key, _ in seen] == ["p0"] * result.probes


def test_silent_drop_of_full_size_packets() -> None:
    prober, net, clock, _ = make()
    net.path_mtu[peer_ip(0)] = 1400
    result = rounds(prober, clock, 2)
    assert result.reachable and result.mtu_ok is None  # two strikes are not yet a verdict
    result = rounds(prober, clock, 1)
    assert result.reachable and result.loss_ratio == 0.0
    assert result.mtu_ok is False
    assert f"{MTU}-byte DF echo" in (result.last_error or "")
    net.path_mtu.clear()  # the operator fixed the MTU
    assert rounds(prober, clock, 1).mtu_ok is True


def test_local_refusal_is_conclusive_at_once() -> None:
    prober, net, clock, _ = make()
    net.local_mtu = 1400
    result = rounds(prober, clock, 1)
    assert result.reachable and result.mtu_ok is False
    assert (result.last_error or "").startswith("message too long")


def test_icmp_fragmentation_needed_is_conclusive() -> None:
    prober, net, clock, _ = make()
    net.icmp_error[peer_ip(0)] = Reply(0, None, "fragmentation needed", too_big=True)
    result = rounds(prober, clock, 1)
    assert result.mtu_ok is False and result.last_error is not None
    assert "fragmentation needed" in result.last_error


def test_loss_over_the_window() -> None:
    prober, net, clock, _ = make(window=20)
    net.drop_small = lambda target, n: n % 4 == 0  # every fourth small echo
    result = rounds(prober, clock, 40)
    assert result.loss_ratio == pytest.approx(0.25)
    assert result.reachable
    # random loss of small echoes does not pass for an MTU problem
    assert result.mtu_ok is True
    net.drop_small = lambda target, n: False
    # rounds 31..50 are in the window now: 32, 36 and 40 lost
    assert rounds(prober, clock, 10).loss_ratio == pytest.approx(3 / 20)
    assert rounds(prober, clock, 10).loss_ratio == 0.0


def test_peer_goes_down_after_down_after_rounds() -> None:
    prober, net, clock, seen = make(down_after=3)
    rounds(prober, clock, 2)
    net.down.add(peer_ip(0))
    states = [rounds(prober, clock, 1).reachable for _ in range(4)]
    assert states == [True, True, False, False]
    result = prober.results()["p0"]
    assert result.rtt_seconds is None and result.loss_ratio == pytest.approx(4 / 6)
    assert result.last_error is not None and "no reply from 10.244.2.0" in result.last_error
    # timed-out echoes are cancelled at the transport, so late replies are ignored
    assert len(net.cancelled) == 2 * 4 and net.outstanding() == 0
    net.down.clear()
    assert rounds(prober, clock, 1).reachable
    assert seen[-1][1].reachable


def test_icmp_error_is_the_reported_error() -> None:
    prober, net, clock, _ = make()
    net.icmp_error[peer_ip(0)] = Reply(0, None, "host unreachable: reported by 10.244.1.0")
    result = rounds(prober, clock, 1)
    assert (result.last_error or "").startswith("host unreachable")


def test_no_mtu_known_sends_only_small_echoes() -> None:
    prober, net, clock, _ = make(mtu=None)
    result = rounds(prober, clock, 2)
    assert {s.size for s in net.sent} == {SMALL_PROBE_BYTES}
    assert result.reachable and result.mtu_ok is None


def test_no_own_address_no_probes() -> None:
    prober, net, clock, _ = make(own=None)
    advance(prober, clock, 11.0)
    assert net.sent == [] and prober.results() == {}


def test_own_address_change_moves_phases_and_source() -> None:
    own = [OWN]
    clock = FakeClock()
    net = FakeNet(clock)
    prober = Prober(net, clock, mtu_provider=lambda: MTU, own_address_provider=lambda: own[0])
    prober.set_peers({"p0": (peer_ip(0), "n0")})
    advance(prober, clock, 10.0)
    own[0] = IPv4Address("10.244.9.0")
    advance(prober, clock, 10.0)
    sends = net.small_sends()
    assert {s.source for s in sends} == {OWN, own[0]}
    new = [s.at for s in sends if s.source == own[0]]
    phase = phase_seconds(str(own[0]), "p0", 5.0)
    assert all(
        math.isclose((t - phase) % 5.0, 0.0, abs_tol=1e-6)
        or math.isclose((t - phase) % 5.0, 5.0, abs_tol=1e-6)
        for t in new
    )


def test_set_peers_add_remove_change() -> None:
    prober, net, clock, _ = make(n_peers=3)
    advance(prober, clock, 10.0)
    before = prober.results()
    assert set(before) == {"p0", "p1", "p2"}
    # p0 keeps its address with a new label, p1 moves, p2 leaves, p3 joins
    prober.set_peers(
        {
            "p0": (peer_ip(0), "renamed"),
            "p1": (IPv4Address("10.244.77.0"), "node1"),
            "p3": (peer_ip(3), "node3"),
        }
    )
    assert set(prober.results()) == {"p0"}  # p1 starts over, p2 is gone
    advance(prober, clock, 10.0)
    after = prober.results()
    assert set(after) == {"p0", "p1", "p3"}
    assert after["p0"].label == "renamed" and after["p0"].probes > before["p0"].probes
    assert after["p1"].target == IPv4Address("10.244.77.0") and after["p1"].probes <= 2
    assert not [s for s in net.sent if s.target == peer_ip(2) and s.at > T0 + 10.0]


def test_removing_a_peer_cancels_its_echoes() -> None:
    prober, net, clock, _ = make()
    net.down.add(peer_ip(0))
    for _ in range(10):  # tick until a round has started and its echoes are out
        if net.outstanding():
            break
        clock.t = prober.tick()
    assert net.outstanding() == 2
    prober.set_peers({})
    assert net.outstanding() == 0 and prober.results() == {}


def test_in_flight_is_bounded() -> None:
    # 100 silent peers, 1 s timeouts, 5 s interval: unbounded, ~40 echoes would be out
    prober, net, clock, _ = make(n_peers=100, max_in_flight=10)
    net.down.update(peer_ip(i) for i in range(100))
    advance(prober, clock, 30.0)
    assert net.max_outstanding == 10
    assert len(prober.results()) > 50  # still makes progress over the peers


def test_a_peer_kept_waiting_for_capacity_is_not_caught_up_in_a_burst() -> None:
    prober, net, clock, _ = make(n_peers=50, max_in_flight=2)
    net.down.update(peer_ip(i) for i in range(50))
    advance(prober, clock, 60.0)
    per_peer = Counter(s.target for s in net.small_sends())
    # never more than one round per interval for any peer
    assert max(per_peer.values()) <= 12


def test_the_loop_sleeps_at_least_a_quantum_between_ticks() -> None:
    """Slots and deadlines spread over the interval ask for ticks tens of milliseconds
    apart: the loop still wakes at most once a quantum, starting and reporting whatever
    fell due in it together."""
    prober, net, clock, _ = make(n_peers=4, max_in_flight=2)
    net.down.update(peer_ip(i) for i in range(4))
    clock.t += 60.0  # every peer due now; the fake clock stands still from here
    ticks: list[float] = []
    tick = prober.tick

    def counted() -> float:
        wake = tick()
        ticks.append(wake - clock())
        return wake

    prober.tick = counted  # type: ignore[method-assign]
    stop = threading.Event()
    loop = threading.Thread(target=prober.run, args=(stop, 0.2))
    loop.start()
    time.sleep(0.5)
    stop.set()
    loop.join(5)
    assert max(ticks) < 0.1  # the prober asked for a look within 0.1 s each time...
    assert 1 <= len(ticks) <= 4  # ...and got one per 0.2 s


def test_clock_jumping_back_does_not_stall() -> None:
    prober, net, clock, _ = make()
    advance(prober, clock, 10.0)
    clock.t -= 3600.0
    n = len(net.small_sends())
    advance(prober, clock, 10.0)
    assert len(net.small_sends()) - n == 2


def test_settings_are_checked() -> None:
    with pytest.raises(ConfigError, match="timeout shorter"):
        make(interval_seconds=1.0, timeout_seconds=1.0)
    with pytest.raises(ConfigError, match="at least"):
        make(window=0)


def test_run_stops_promptly() -> None:
    clock_net = FakeClock()
    net = FakeNet(clock_net)
    prober = Prober(
        net,
        time.monotonic,
        mtu_provider=lambda: MTU,
        own_address_provider=lambda: OWN,
        interval_seconds=0.2,
        timeout_seconds=0.1,
    )
    prober.set_peers({"p0": (peer_ip(0), "n0")})
    stop = threading.Event()
    thread = threading.Thread(target=prober.run, args=(stop,))
    started = time.monotonic()
    thread.start()
    wait_until(lambda: len(net.small_sends()) >= 2, 5.0, "two probe rounds")  # it runs on its own
    stop.set()
    thread.join(timeout=1.0)
    assert not thread.is_alive()
    # One round per 0.2 s slot the run lasted (and the first one), however late it ran.
    assert len(net.small_sends()) <= (time.monotonic() - started) / 0.2 + 2


# --- scheduling properties ------------------------------------------------------------

names = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-./", min_size=1, max_size=20)


@settings(max_examples=50, deadline=None)
@given(
    peers=st.sets(names, min_size=1, max_size=25),
    interval=st.sampled_from([0.5, 1.0, 5.0, 7.5, 30.0]),
    start=st.floats(min_value=0, max_value=2e9),
)
def test_each_peer_is_probed_once_per_interval_at_its_phase(
    peers: set[str], interval: float, start: float
) -> None:
    clock = FakeClock(start)
    net = FakeNet(clock)
    prober = Prober(
        net,
        clock,
        mtu_provider=lambda: MTU,
        own_address_provider=lambda: OWN,
        interval_seconds=interval,
        timeout_seconds=interval / 5,
    )
    keyed = {p: (peer_ip(i), p) for i, p in enumerate(sorted(peers))}
    prober.set_peers(keyed)
    advance(prober, clock, 6 * interval)
    for key, (target, _) in keyed.items():
        times = [s.at for s in net.small_sends(target)]
        assert len(times) in (6, 7)  # 6 whole intervals, plus one if the phase hit the edge
        gaps = [b - a for a, b in itertools.pairwise(times)]
        assert all(math.isclose(g, interval, rel_tol=1e-9, abs_tol=1e-5) for g in gaps)
        phase = phase_seconds(str(OWN), key, interval)
        offset = (times[0] - phase) % interval
        assert min(offset, interval - offset) < 1e-5


@settings(max_examples=30, deadline=None)
@given(peers=st.sets(names, min_size=64, max_size=300), interval=st.floats(0.5, 60.0))
def test_phases_spread_peers_evenly(peers: set[str], interval: float) -> None:
    n = len(peers)
    bins = Counter(int(phase_seconds("10.244.1.0", p, interval) / interval * 4) for p in peers)
    assert set(bins) <= {0, 1, 2, 3}
    # Binomial(n, 1/4): six standard deviations of slack, so a false alarm is ~1e-9
    slack = 6 * math.sqrt(n * 3 / 16)
    assert all(abs(bins[b] - n / 4) <= slack for b in range(4))


@settings(max_examples=20, deadline=None)
@given(n_nodes=st.integers(12, 40))
def test_all_pairs_probes_of_a_cluster_do_not_collide(n_nodes: int) -> None:
    # N nodes each probing N-1 peers: in no tenth of the interval more than twice the mean
    nodes = [str(IPv4Address("10.244.0.0") + 256 * (i + 1)) for i in range(n_nodes)]
    phases = [phase_seconds(a, b, 5.0) for a in nodes for b in nodes if a != b]
    per_tenth = Counter(int(p / 0.5) for p in phases)
    mean = len(phases) / 10
    assert max(per_tenth.values()) <= 2 * mean


def test_phase_is_stable_and_depends_on_both_ends() -> None:
    assert phase_seconds("a", "b", 5.0) == phase_seconds("a", "b", 5.0)
    assert phase_seconds("a", "b", 5.0) != phase_seconds("b", "a", 5.0)
    assert 0 <= phase_seconds("a", "b", 5.0) < 5.0


@pytest.mark.parametrize(
    ("now", "phase", "interval", "first", "after"),
    [
        (100.0, 2.0, 5.0, 102.0, 107.0),
        (102.0, 2.0, 5.0, 102.0, 107.0),  # exactly on the slot: probe now
        (102.5, 2.0, 5.0, 107.0, 112.0),
        (0.0, 4.9, 5.0, 4.9, 9.9),
    ],
)
def test_slots(now: float, phase: float, interval: float, first: float, after: float) -> None:
    assert first_slot(now, phase, interval) == pytest.approx(first)
    assert slot_after(first, first, interval) == pytest.approx(after)


def test_slot_after_skips_missed_slots() -> None:
    assert slot_after(100.0, 123.0, 5.0) == pytest.approx(125.0)
    assert slot_after(100.0, 125.0, 5.0) == pytest.approx(130.0)


# --- ICMP encoding ------------------------------------------------------------------------


@pytest.mark.parametrize("payload", [0, 1, 56, 1422])
def test_echo_request_checksum_verifies(payload: int) -> None:
    packet = echo_request(0x1234, 7, payload)
    assert len(packet) == 8 + payload
    assert packet[0] == 8 and packet[1] == 0
    assert icmp_checksum(packet) == 0  # a correct checksum sums to zero


def test_checksum_known_value() -> None:
    # RFC 1071's example words 0001 f203 f4f5 f6f7 sum to ddf2 (one's complement 220d)
    assert icmp_checksum(bytes.fromhex("0001f203f4f5f6f7")) == 0x220D


# --- a bounded number of peers per interval ----------------------------------------------


@pytest.mark.parametrize(
    ("n", "per_interval", "cycle"),
    [
        (0, 100, 5.0),
        (1, 100, 5.0),
        (100, 100, 5.0),
        (101, 100, 10.0),
        (1000, 100, 50.0),
        (5000, 64, 5.0 * 79),
    ],
)
def test_cycle_covers_every_peer_within_the_budget(n: int, per_interval: int, cycle: float) -> None:
    assert cycle_seconds(n, 5.0, per_interval) == cycle


@pytest.mark.parametrize(
    ("cycle", "n", "expected"),
    [
        (5.0, 101, 10.0),  # outgrown: longer at once
        (10.0, 100, 10.0),  # back within the shorter budget, but at its edge: kept
        (10.0, 91, 10.0),
        (10.0, 90, 5.0),  # a tenth of the budget free below it: shorter
        (50.0, 10, 5.0),
        (50.0, 1000, 50.0),
    ],
)
def test_the_cycle_grows_at_once_and_shrinks_with_a_margin(
    cycle: float, n: int, expected: float
) -> None:
    assert cycle_after(cycle, n, 5.0, 100) == expected


def test_a_peer_coming_and_going_at_the_budget_s_edge_costs_that_peer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """At 100 peers and 100 per interval, a 101st peer lengthens the cycle (every peer's
    slot moves, by a multiplication: no phase is hashed again); its lease coming and
    going after that leaves the cycle and the others' slots alone, and hashes its own
    phase only. Each phase is the pair's hash over the current cycle."""
    prober, _, clock, _ = make(n_peers=100, peers_per_interval=100)
    advance(prober, clock, 10.0)
    hashed: list[str] = []
    real = prober_module.phase_unit

    def counting(own: str, peer: str) -> float:
        hashed.append(peer)
        return real(own, peer)

    monkeypatch.setattr(prober_module, "phase_unit", counting)
    edge = ("p100", (peer_ip(100), "node100"))
    prober.change_peers(dict([edge]), [])
    assert prober.cycle == 10.0 and hashed == ["p100"]
    slots = {key: peer.next_due for key, peer in prober._peers.items()}
    for _ in range(3):
        prober.change_peers({}, ["p100"])
        prober.change_peers(dict([edge]), [])
    assert prober.cycle == 10.0 and hashed == ["p100"] * 4
    assert {k: p.next_due for k, p in prober._peers.items() if k != "p100"} == {
        k: due for k, due in slots.items() if k != "p100"
    }
    for key, peer in prober._peers.items():
        assert peer.phase_unit * prober.cycle == phase_seconds(str(OWN), key, 10.0)
    prober.change_peers({}, [f"p{i}" for i in range(90, 101)])
    assert prober.cycle == 5.0 and len(hashed) == 4


@pytest.mark.parametrize(
    ("due", "now", "phase", "period", "expected"),
    [
        (10.0, 10.0, 0.0, 5.0, 15.0),
        (10.0, 12.0, 0.0, 5.0, 15.0),
        (10.0, 31.0, 0.0, 5.0, 35.0),
        (50.0, 12.0, 2.0, 5.0, 52.0),
        (3.0, 3.0, 3.0, 50.0, 53.0),
    ],
)
def test_next_slot(due: float, now: float, phase: float, period: float, expected: float) -> None:
    assert next_slot(due, now, phase, period) == expected


@pytest.mark.parametrize(
    ("latest", "reachable", "mtu_ok", "expected"),
    [
        (OK, True, True, False),
        (LOST, True, True, True),  # one lost round: confirm it soon
        (LOST, False, None, False),  # settled as down: back to the cycle
        (STRIKE, True, None, True),  # strikes towards an MTU verdict
        (STRIKE, True, False, False),  # the MTU verdict is in
        (REFUSED, True, False, False),  # conclusive at once
        (SMALL_ONLY, True, None, False),
    ],
)
def test_needs_confirmation(
    latest: RoundOutcome, reachable: bool, mtu_ok: bool | None, expected: bool
) -> None:
    result = ProbeResult(reachable, None, 0.0, mtu_ok, latest.error, 1)
    assert needs_confirmation(latest, result) is expected


def test_a_large_cluster_is_covered_once_per_cycle_within_the_budget() -> None:
    prober, net, clock, _ = make(n_peers=1000, peers_per_interval=100, max_in_flight=256)
    assert prober.cycle == 50.0
    start = clock.t
    advance(prober, clock, 200.0)
    per_peer = Counter(s.target for s in net.small_sends())
    assert len(per_peer) == 1000 and set(per_peer.values()) <= {4, 5}  # 4 whole cycles
    per_interval = Counter(int((s.at - start) // 5.0) for s in net.small_sends())
    # Binomial(1000, 1/10) per interval: mean 100, sd ~9.5; never the whole cluster at once
    assert max(per_interval.values()) < 150
    assert len(net.small_sends()) <= 1000 * 4 + 1000


def test_a_failing_peer_is_confirmed_within_intervals_not_cycles() -> None:
    prober, net, clock, _ = make(n_peers=1000, peers_per_interval=100, max_in_flight=256)
    advance(prober, clock, 60.0)  # every peer has a result
    victim = peer_ip(7)
    net.down.add(victim)
    rounds(prober, clock, 1, "p7")  # the first failing round comes within one cycle
    lost_at = clock.t
    assert prober.results()["p7"].reachable  # one lost round is loss, not an outage
    while prober.results()["p7"].reachable:
        clock.t = max(prober.tick(), clock.t)
    # down_after = 3: two more rounds, an interval apart (plus the 1 s timeout)
    assert clock.t - lost_at <= 2 * 5.0 + 1.0 + 1e-6
    settled = clock.t
    advance(prober, clock, 100.0)  # settled as down: once per cycle again
    later = [s.at for s in net.small_sends(victim) if s.at > settled]
    assert len(later) == 2


def test_a_peer_that_joins_is_probed_within_an_interval() -> None:
    prober, net, clock, _ = make(n_peers=999, peers_per_interval=100, max_in_flight=256)
    advance(prober, clock, 60.0)
    peers = {f"p{i}": (peer_ip(i), f"node{i}") for i in range(1000)}
    prober.set_peers(peers)  # p999 joins; the cycle stays 50 s
    joined = clock.t
    rounds(prober, clock, 1, "p999")
    assert clock.t - joined <= 5.0 + 1.0
    first = [s.at for s in net.small_sends(peer_ip(999))]
    advance(prober, clock, 100.0)  # healthy: then once per cycle
    assert len(net.small_sends(peer_ip(999))) - len(first) == 2


def test_a_growing_cluster_lengthens_the_cycle() -> None:
    prober, net, clock, _ = make(n_peers=100, peers_per_interval=100)
    assert prober.cycle == 5.0
    advance(prober, clock, 20.0)
    prober.set_peers({f"p{i}": (peer_ip(i), f"node{i}") for i in range(250)})
    assert prober.cycle == 15.0
    n = len(net.sent)
    advance(prober, clock, 60.0)
    per_peer = Counter(s.target for s in net.sent[n:] if s.size == SMALL_PROBE_BYTES)
    assert len(per_peer) == 250 and set(per_peer.values()) <= {4, 5}


def test_a_mass_outage_hurries_a_bounded_number_of_peers() -> None:
    prober, net, clock, _ = make(n_peers=1000, peers_per_interval=100, max_in_flight=256)
    advance(prober, clock, 60.0)
    net.down.update(peer_ip(i) for i in range(1000))
    n, start = len(net.small_sends()), clock.t
    advance(prober, clock, 50.0)  # one cycle
    per_interval = Counter(int((s.at - start) // 5.0) for s in net.small_sends()[n:])
    # the cycle's ~100 per interval plus at most 25 hurried peers, each once per interval
    assert max(per_interval.values()) <= 150
    assert sum(per_interval.values()) <= 1000 + 10 * 25
    advance(prober, clock, 150.0)  # three more cycles: every peer settles as down
    assert not any(r.reachable for r in prober.results().values())


# --- the IPv6 side of a dual-stack peer ----------------------------------------------

OWN6 = IPv6Address("fd10:244:0:1::")


def make_dual(
    n_peers: int, own6: IPv6Address | None = OWN6, **kwargs: object
) -> tuple[Prober, FakeNet, FakeClock]:
    """Each peer probed in both families: ``p<i>`` over IPv4, ``p<i>v6`` over IPv6."""
    clock = FakeClock()
    net = FakeNet(clock)
    options: dict = {"interval_seconds": 5.0, "timeout_seconds": 1.0, **kwargs}
    prober = Prober(
        net,
        clock,
        mtu_provider=lambda: MTU,
        own_address_provider=lambda: OWN,
        own_address6_provider=lambda: own6,
        **options,
    )
    peers: dict[str, tuple[IPv4Address | IPv6Address, str]] = {}
    for i in range(n_peers):
        peers[f"p{i}"] = (peer_ip(i), f"node{i}")
        peers[f"p{i}v6"] = (peer_ip6(i), f"node{i}")
    prober.set_peers(peers)
    return prober, net, clock


def peer_ip6(i: int) -> IPv6Address:
    return IPv6Address(f"fd10:244:0:{i + 2:x}::")


def test_ipv6_side_is_probed_from_our_ipv6_address_at_its_own_sizes() -> None:
    prober, net, clock = make_dual(1)
    net.path_mtu[peer_ip6(0)] = MTU - 20  # flanneld: 20 bytes short
    v6 = rounds(prober, clock, 3, "p0v6")
    sent6 = [s for s in net.sent if s.target == peer_ip6(0)]
    assert {s.source for s in sent6} == {OWN6}
    assert {s.size for s in sent6} == {SMALL_PROBE_BYTES6, MTU}
    assert v6.family == "ipv6" and v6.target == peer_ip6(0)
    assert v6.reachable and v6.mtu_ok is False  # small answered, full size lost 3 times
    assert f"{MTU}-byte DF echo" in (v6.last_error or "")
    v4 = prober.results()["p0"]
    assert v4.family == "ipv4" and v4.mtu_ok is True
    assert {s.source for s in net.sent if s.target == peer_ip(0)} == {OWN}


def test_ipv6_side_waits_while_we_have_no_ipv6_address() -> None:
    prober, net, clock = make_dual(2, own6=None)
    advance(prober, clock, 20.0)
    assert net.sent and all(s.target.version == 4 for s in net.sent)
    assert set(prober.results()) == {"p0", "p1"}


def test_the_budget_counts_both_families() -> None:
    # 50 dual-stack peers are 100 probed sides: at 50 per interval, a two-interval cycle
    prober, net, clock = make_dual(50, peers_per_interval=50)
    assert prober.cycle == 10.0
    start = clock.t
    advance(prober, clock, 40.0)
    per_side = Counter(s.target for s in net.small_sends())
    per_side6 = Counter(s.target for s in net.sent if s.size == SMALL_PROBE_BYTES6)
    assert len(per_side) == 50 and len(per_side6) == 50
    assert set(per_side.values()) | set(per_side6.values()) <= {4, 5}  # 4 whole cycles
    smalls = [s for s in net.sent if s.size in (SMALL_PROBE_BYTES, SMALL_PROBE_BYTES6)]
    assert len(smalls) <= 100 * 4 + 100
    assert all(s.at - start <= 40.0 for s in smalls)


def _icmp6_matcher(target: IPv6Address, seq: int) -> Icmp6Transport:
    """The ICMPv6 transport's matching, without its socket: one echo outstanding."""
    t = Icmp6Transport.__new__(Icmp6Transport)
    t._ident, t._lock = 0x4242, threading.Lock()
    t._pending = {seq: (target, 10.0)}
    return t


def _quoted6(target: IPv6Address, ident: int, seq: int) -> bytes:
    """What an ICMPv6 error quotes: our packet's IPv6 header, then our echo."""
    header = struct.pack("!IHBB", 6 << 28, 1402, 58, 64) + OWN6.packed + target.packed
    return header + echo6_request(ident, seq, 16)


def test_icmp6_matching_of_replies_and_errors() -> None:
    peer = peer_ip6(0)
    reply = struct.pack("!BBHHH", 129, 0, 0, 0x4242, 9) + b"x" * 8
    assert _icmp6_matcher(peer, 9)._match(reply, peer, 10.5) == Reply(9, 0.5)
    assert _icmp6_matcher(peer, 9)._match(reply, peer_ip6(1), 10.5) is None  # other sender
    other = struct.pack("!BBHHH", 129, 0, 0, 0x4343, 9)
    assert _icmp6_matcher(peer, 9)._match(other, peer, 10.5) is None  # another process's
    router = IPv6Address("fd00:64::1")
    too_big = struct.pack("!BBHI", 2, 0, 0, 1430) + _quoted6(peer, 0x4242, 9)
    got = _icmp6_matcher(peer, 9)._match(too_big, router, 10.5)
    assert got is not None and got.too_big and got.ticket == 9
    assert got.error == f"packet too big: {router} forwards at most 1430 bytes towards {peer}"
    unreach = struct.pack("!BBHI", 1, 3, 0, 0) + _quoted6(peer, 0x4242, 9)
    got = _icmp6_matcher(peer, 9)._match(unreach, router, 10.5)
    assert got is not None and not got.too_big
    assert got.error == f"address unreachable: reported by {router} for {peer}"
    for truncated in (too_big[:8], too_big[:50], b"", reply[:7]):
        assert _icmp6_matcher(peer, 9)._match(truncated, router, 10.5) is None


# --- the agent's peer set: one entry per family ----------------------------------------


def _dual_peer(n: int, backend: str = "vxlan", v6: bool = True) -> Lease:
    data = {"VNI": 1, "VtepMAC": f"02:00:00:00:00:{n:02x}"} if backend == "vxlan" else None
    return Lease(
        subnet=IPv4Network(f"10.244.{n}.0/24"),
        ipv6_subnet=IPv6Network(f"fd10:244:0:{n:x}::/64") if v6 else None,
        attrs=LeaseAttrs(
            public_ip=IPv4Address(f"192.168.1.{n}"),
            backend_type=backend,
            backend_data=data,
            public_ipv6=IPv6Address(f"fd00:64::{n:x}") if v6 else None,
            backend_v6_data=data if v6 else None,
            node_name=f"n{n}",
        ),
    )


def _dual_ctx(backend: str) -> NodeContext:
    config = parse_network_config(
        json.dumps(
            {
                "Network": "10.244.0.0/16",
                "EnableIPv6": True,
                "IPv6Network": "fd10:244::/56",
                "Backend": {"Type": backend},
            }
        )
    )
    under = UnderlayInterface(
        name="eth0",
        index=2,
        ip=IPv4Address("192.168.1.1"),
        networks=(IPv4Network("192.168.1.0/24"),),
        mtu=1500,
        ip6=IPv6Address("fd00:64::1"),
        networks6=(IPv6Network("fd00:64::/64"),),
    )
    return NodeContext(
        config=config,
        underlay=under,
        public_ip=IPv4Address("192.168.1.1"),
        node_name="n1",
        public_ipv6=IPv6Address("fd00:64::1"),
    )


def test_probe_peers_add_the_ipv6_side_where_the_peer_answers() -> None:
    vxlan, hostgw, v4only = _dual_peer(2), _dual_peer(3, "host-gw"), _dual_peer(4, v6=False)
    got = probe_peers([vxlan, hostgw, v4only], ipv6=True)
    assert got == {
        "10.244.2.0/24": (IPv4Address("10.244.2.1"), "n2"),
        "fd10:244:0:2::/64": (IPv6Address("fd10:244:0:2::"), "n2"),  # its flannel-v6 VTEP
        "10.244.3.0/24": (IPv4Address("10.244.3.1"), "n3"),
        "fd10:244:0:3::/64": (IPv6Address("fd10:244:0:3::1"), "n3"),  # cni0's gateway
        "10.244.4.0/24": (IPv4Address("10.244.4.1"), "n4"),
    }
    assert set(probe_peers([vxlan, hostgw], ipv6=False)) == {"10.244.2.0/24", "10.244.3.0/24"}
    # One of ours (it advertises its MTU) at cni0's gateway, VTEP or not: its VTEP's
    # address is the Subnet-Router anycast of cni0's /64, answered from another address.
    ours = replace(vxlan, attrs=replace(vxlan.attrs, mtu=1430))
    assert probe_peers([ours], ipv6=True)["fd10:244:0:2::/64"][0] == IPv6Address("fd10:244:0:2::1")
    own = _dual_peer(1)
    assert probe_source6(_dual_ctx("vxlan"), own) == IPv6Address("fd10:244:0:1::")
    assert probe_source6(_dual_ctx("host-gw"), own) == IPv6Address("fd10:244:0:1::1")
    assert probe_source6(_dual_ctx("vxlan"), _dual_peer(1, v6=False)) is None
    assert probe_source6(_dual_ctx("vxlan"), None) is None


def test_peers_changed_by_difference_are_the_peers_set_whole() -> None:
    """The planner tells the prober what changed (a lease memo's delta through
    change_peers); after every step its peers, addresses, labels and schedule are those
    of a prober given the whole set each time (set_peers)."""
    rnd = random.Random(5)
    whole, _, clock_a, _ = make(n_peers=0)
    by_difference, _, clock_b, _ = make(n_peers=0)
    memo: LeaseMemo[ProbeEntries] = LeaseMemo()
    leases: dict[int, Lease] = {}
    for _ in range(60):
        for _ in range(rnd.randint(1, 4)):
            n = rnd.randint(2, 40)
            if n in leases and rnd.random() < 0.4:
                del leases[n]
            else:  # a new peer, or a new lease object (a new label or address) for one
                lease = _dual_peer(n, v6=rnd.random() < 0.5)
                name = f"n{n}-{rnd.randint(0, 2)}"
                leases[n] = replace(lease, attrs=replace(lease.attrs, node_name=name))
        peers = list(leases.values())
        whole.set_peers(probe_peers(peers, ipv6=True))
        delta = memo.update(True, peers, lambda p: probe_entries(p, True))
        by_difference.change_peers(
            {key: value for entries in delta.added for key, value in entries},
            [key for entries in delta.dropped for key, _ in entries],
        )
        assert {k: (p.target, p.label, p.phase_unit) for k, p in by_difference._peers.items()} == {
            k: (p.target, p.label, p.phase_unit) for k, p in whole._peers.items()
        }
        assert by_difference.cycle == whole.cycle
        advance(whole, clock_a, 1.0)
        advance(by_difference, clock_b, 1.0)
