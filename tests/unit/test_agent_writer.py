"""The one writer and the agent's lifecycle: events are counted where tests and
operators read them, readers see whole states only, a dying task stops the agent."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from ipaddress import IPv4Address, IPv4Network
from pathlib import Path

import pytest

from flannelpy.agent.events import (
    EVENT_KINDS,
    TICK_STATUS,
    CapacityLow,
    ProbeReported,
    Stop,
    Tick,
    kind_of,
)
from flannelpy.agent.node import THREAD_GRACE_SECONDS
from flannelpy.observe.probe_verdict import ProbeResult
from flannelpy.observe.prober import Prober
from flannelpy.subnet.keys import lease_key
from flannelpy.subnet.lease import LeaseAttrs
from tests.support.agent_fakes import PREFIX, AgentHarness

PROBE = ProbeResult(
    reachable=True, rtt_seconds=0.001, loss_ratio=0.0, mtu_ok=True, last_error=None, probes=1
)


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[AgentHarness]:
    harness = AgentHarness(tmp_path)
    harness.start()
    harness.drain()
    yield harness
    harness.stop()


def sample(h: AgentHarness, kind: str) -> float:
    value = h.agent.metrics.registry.get_sample_value(
        "flannelpy_agent_events_total", {"kind": kind}
    )
    assert value is not None, f"no flannelpy_agent_events_total series for kind={kind}"
    return value


def test_every_kind_is_counted_in_metrics_and_status(agent: AgentHarness) -> None:
    before = agent.writer.counts.events()
    assert set(before) == set(EVENT_KINDS)
    assert {k: sample(agent, k) for k in EVENT_KINDS} == before

    agent.put(CapacityLow(free=0))
    agent.put(ProbeReported((("10.244.9.0/24", PROBE),)))
    agent.put(Tick(TICK_STATUS))
    assert agent.drain() == 3

    after = agent.writer.counts.events()
    assert after["capacity"] == before["capacity"] + 1
    assert after["probe"] == before["probe"] + 1
    assert after["tick"] == before["tick"] + 1
    assert {k: sample(agent, k) for k in EVENT_KINDS} == after
    # The status tick wrote status.json while handling it: every event before it counted.
    status = agent.status()
    assert status["events"]["capacity"] == after["capacity"]
    assert status["events"]["probe"] == after["probe"]
    assert status["capacity_checks"] == agent.writer.counts.capacity_checks


def test_stop_is_not_counted() -> None:
    assert kind_of(Stop()) is None
    assert {kind_of(e) for e in (CapacityLow(1), Tick("status"))} == {"capacity", "tick"}


def test_readers_get_a_frozen_view(agent: AgentHarness) -> None:
    view = agent.writer.view
    assert view.own == tuple(agent.writer.state.own)
    with pytest.raises(AttributeError):
        view.ready = False  # type: ignore[misc]
    agent.writer.state.ready = False  # the writer's own record changes...
    assert view.ready, "...a published view does not"


def test_a_dying_task_stops_the_agent(agent: AgentHarness) -> None:
    class Died(RuntimeError):
        pass

    def die(stop: threading.Event) -> None:
        raise Died("a root task failed")

    agent.agent._spawn("doomed", die)
    started = time.monotonic()
    with pytest.raises(Died):
        agent.agent.run_until_stopped()
    assert agent.agent.stop.is_set()
    assert time.monotonic() - started < THREAD_GRACE_SECONDS
    assert not agent.pods or not agent.pods.started
    assert all(not t.is_alive() for t in agent.agent._threads)


class _NoTransport:
    """The prober is never run here: only its peer set is followed."""

    def send(self, *_: object) -> int:
        raise AssertionError("no probe is sent")


def test_a_peer_that_leaves_takes_its_probe_series_and_a_late_round_adds_none(
    agent: AgentHarness,
) -> None:
    """The planner tells the metrics which peers the prober stopped following; a round
    that began before its peer left reports after, and is not shown."""
    prober = Prober(
        _NoTransport(),  # type: ignore[arg-type]
        mtu_provider=lambda: 1450,
        own_address_provider=lambda: None,
    )
    agent.writer.planner.prober = prober
    for third in (7, 8):
        attrs = LeaseAttrs(public_ip=IPv4Address(f"192.168.1.{third}"), backend_type="host-gw")
        agent.store.put(
            lease_key(PREFIX, IPv4Network(f"10.244.{third}.0/24")), attrs.to_json().encode()
        )
    agent.deliver_leases()
    assert prober.follows("10.244.7.0/24") and prober.follows("10.244.8.0/24")
    agent.put(ProbeReported((("10.244.7.0/24", PROBE), ("10.244.8.0/24", PROBE))))
    agent.drain()

    def probed() -> set[str]:
        return {
            dict(labels)["peer"]
            for name, labels in _series(agent)
            if name == "flannelpy_peer_reachable"
        }

    assert probed() == {"10.244.7.0/24", "10.244.8.0/24"}
    gone = agent.store.get(lease_key(PREFIX, IPv4Network("10.244.7.0/24")))
    assert gone is not None
    assert agent.store.delete_if_mod_revision(gone.key, gone.mod_revision)
    agent.deliver_leases()
    assert not prober.follows("10.244.7.0/24")
    assert probed() == {"10.244.8.0/24"}
    agent.put(ProbeReported((("10.244.7.0/24", PROBE),)))  # the late round
    agent.drain()
    assert probed() == {"10.244.8.0/24"}


def _series(agent: AgentHarness) -> list[tuple[str, frozenset[tuple[str, str]]]]:
    return [
        (sample.name, frozenset(sample.labels.items()))
        for family in agent.agent.metrics.registry.collect()
        for sample in family.samples
    ]
