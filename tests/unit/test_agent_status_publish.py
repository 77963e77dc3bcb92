"""The status record is a budget: with nothing changing a node writes it at most once per
heartbeat (240-300 s with the default interval), a change an operator acts on is
written at once, a rollout in progress follows the probe rounds, and the record stays
small whatever the number of peers."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import replace
from ipaddress import IPv4Address, IPv6Network
from itertools import pairwise
from pathlib import Path

import pytest

from flannelpy.agent.events import TICK_STATUS
from flannelpy.control.records import NodeStatus
from flannelpy.observe.probe_verdict import ProbeResult
from flannelpy.store.etcd.kv import FakeStore
from flannelpy.subnet.keys import rollout_key, status_key
from tests.support.agent_fakes import NODE, PREFIX, AgentHarness, FakeClock

START = 1_700_000_000.0
TICK = 2.0  # the agent's status tick
HOUR = 3600.0


class CountingStore(FakeStore):
    """Remembers when each status record was written, and how big it was."""

    def __init__(self, clock: FakeClock) -> None:
        super().__init__(clock=clock)
        self.clock = clock
        self.writes: list[tuple[float, int]] = []

    def put(self, key: str, value: bytes, lease_id: int = 0) -> int:
        if key == status_key(PREFIX, NODE):
            self.writes.append((self.clock(), len(value)))
        return super().put(key, value, lease_id)


class FakeProber:
    """Results for ``count`` peers; each round only raises their round counters."""

    def __init__(self, count: int) -> None:
        self.current = {
            f"10.{i // 256}.{i % 256}.0/24": ProbeResult(
                reachable=True,
                rtt_seconds=0.001,
                loss_ratio=0.0,
                mtu_ok=True,
                last_error=None,
                probes=0,
                target=IPv4Address(f"10.{i // 256}.{i % 256}.0"),
            )
            for i in range(count)
        }

    def results(self) -> dict[str, ProbeResult]:
        return dict(self.current)

    def round(self, h: AgentHarness, **change: object) -> None:
        for key, r in self.current.items():
            self.current[key] = replace(r, probes=r.probes + 1, **change)  # type: ignore[arg-type]
            h.writer.on_probes([(key, self.current[key])])


# The heartbeat's spread: none (300 s), the most (240 s), and a seeded mix of both.
JITTERS = {"none": lambda: 0.0, "most": lambda: 1.0, "seeded": random.Random(28).random}


@pytest.fixture
def harness(
    tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[tuple[AgentHarness, CountingStore, FakeProber]]:
    clock = FakeClock(START)
    store = CountingStore(clock)
    jitter = JITTERS[getattr(request, "param", "seeded")]
    h = AgentHarness(tmp_path, store=store, clock=clock, jitter=jitter)
    h.start()
    h.drain()
    prober = FakeProber(20)
    h.writer.status.prober = prober  # type: ignore[assignment]
    yield h, store, prober
    h.stop()


def run(h: AgentHarness, prober: FakeProber, seconds: float) -> None:
    """What the agent does meanwhile: a probe round to every peer per tick, status ticks."""
    end = h.clock.now + seconds
    while h.clock.now < end:
        prober.round(h)
        h.tick(TICK_STATUS, advance=TICK)


def writes_between(store: CountingStore, start: float, end: float) -> list[float]:
    return [at for at, _ in store.writes if start <= at < end]


@pytest.mark.parametrize("harness", sorted(JITTERS), indirect=True)
def test_nothing_changing_writes_at_most_once_per_heartbeat(harness) -> None:  # type: ignore[no-untyped-def]
    h, store, prober = harness
    run(h, prober, 120.0)  # past the start's settling minute
    steady = h.clock.now
    run(h, prober, HOUR)
    times = writes_between(store, steady, steady + HOUR)
    gaps = [b - a for a, b in pairwise(times)]
    # A heartbeat is 300 s jittered down to 240 s: an hour holds 12 to 15 of them.
    assert len(times) <= HOUR / 240 + 1, f"{len(times)} writes in an hour: {times[:10]}"
    assert all(240.0 <= g <= 300.0 + TICK for g in gaps), gaps  # a jittered heartbeat
    assert len(times) >= HOUR / 300 - 1, "the heartbeat keeps the record fresh"


def test_a_failing_peer_is_written_at_once_and_noise_is_not(harness) -> None:  # type: ignore[no-untyped-def]
    h, store, prober = harness
    run(h, prober, 120.0)
    before = len(store.writes)
    # One lost echo is loss, not a failing peer: nothing an operator acts on.
    key = next(iter(prober.current))
    prober.current[key] = replace(prober.current[key], last_error="one echo lost")
    h.writer.on_probes([(key, prober.current[key])])
    h.tick(TICK_STATUS, advance=TICK)
    assert len(store.writes) == before
    prober.current[key] = replace(prober.current[key], reachable=False)
    h.writer.on_probes([(key, prober.current[key])])
    h.tick(TICK_STATUS, advance=TICK)
    assert len(store.writes) == before + 1
    record = NodeStatus.from_json(store.get(status_key(PREFIX, NODE)).value)  # type: ignore[union-attr]
    assert record.probes.failing == 1 and record.probes.failing_peers[0].subnet == key
    assert record.probes.peers == 20


def test_a_rollout_in_progress_follows_probe_rounds_only_while_it_runs(harness) -> None:  # type: ignore[no-untyped-def]
    h, store, prober = harness
    run(h, prober, 120.0)
    h.store.put(rollout_key(PREFIX), json.dumps({"id": "r1", "state": "running"}).encode())
    h.deliver_control()
    start = h.clock.now
    run(h, prober, 60.0)
    during = writes_between(store, start, h.clock.now)
    assert len(during) >= 60.0 / (h.settings.probe_interval + TICK) - 1, during
    record = NodeStatus.from_json(store.get(status_key(PREFIX, NODE)).value)  # type: ignore[union-attr]
    assert record.probes.passed_at is not None and record.probes.passed_at > start
    h.store.put(rollout_key(PREFIX), json.dumps({"id": "r1", "state": "done"}).encode())
    h.deliver_control()
    after = h.clock.now
    run(h, prober, 600.0)
    assert len(writes_between(store, after, h.clock.now)) <= 3


def test_the_record_stays_small_with_a_thousand_peers(harness) -> None:  # type: ignore[no-untyped-def]
    h, store, _ = harness
    prober = FakeProber(1000)
    h.writer.status.prober = prober  # type: ignore[assignment]
    for i, key in enumerate(prober.current):
        if i % 3 == 0:  # a third of them failing, too
            prober.current[key] = replace(prober.current[key], reachable=False)
    prober.round(h)
    h.tick(TICK_STATUS, advance=TICK)
    size = store.writes[-1][1]
    assert size < 2048, f"a status record of {size} bytes with 1,000 peers"
    record = NodeStatus.from_json(store.get(status_key(PREFIX, NODE)).value)  # type: ignore[union-attr]
    assert (record.probes.peers, record.probes.failing) == (1000, 334)
    assert len(record.probes.failing_peers) == 5


def test_a_dual_stack_node_lists_both_families_subnets_for_the_rollout(harness) -> None:  # type: ignore[no-untyped-def]
    h, _, _ = harness
    own = h.writer.state.own[0]
    h.writer.state.own[0] = replace(own, ipv6_subnet=IPv6Network("fc00:0:0:5::/64"))
    assert h.writer.status.node_status().subnets == (str(own.subnet), "fc00:0:0:5::/64")


def test_the_summary_follows_new_rounds_and_peers_that_leave(harness) -> None:  # type: ignore[no-untyped-def]
    h, _, prober = harness
    run(h, prober, 10.0)
    status = h.writer.status
    first = status.node_status().probes
    assert (first.peers, first.ok, first.failing) == (20, 20, 0)
    assert status.node_status().probes is first  # no new round: the summary is not redone
    down, gone = list(prober.current)[:2]
    first_result = prober.current[gone]
    prober.current[down] = replace(prober.current[down], reachable=False)
    h.writer.on_probes([(down, prober.current[down])])
    h.drain()
    summary = status.node_status().probes
    assert (summary.peers, summary.ok, summary.failing) == (20, 19, 1)
    assert [f.subnet for f in summary.failing_peers] == [down]
    del prober.current[gone]  # the peer left: the prober has no result for it any more
    del prober.current[down]
    summary = status.node_status().probes
    assert (summary.peers, summary.ok, summary.failing, summary.failing_peers) == (18, 18, 0, ())
    back = replace(first_result, probes=first_result.probes + 1)
    prober.current[gone] = back  # it came back, with a new round
    h.writer.on_probes([(gone, back)])
    h.drain()
    summary = status.node_status().probes
    assert (summary.peers, summary.ok, summary.failing) == (19, 19, 0)
