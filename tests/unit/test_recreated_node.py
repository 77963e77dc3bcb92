"""A node re-created with a new address under its old name gets its subnet back once the
old holder's status heartbeat has been silent three intervals and two minutes (17 min by
default), not when its etcd lease runs out (up to 23 h later); two live nodes with one
name are still refused. The old holder is a real agent on fakes writing its record."""

from __future__ import annotations

import random
from dataclasses import replace
from ipaddress import IPv4Address
from pathlib import Path
from typing import Any

import pytest

from flannelpy.agent.events import TICK_STATUS
from flannelpy.control.records import (
    BackendSummary,
    NodeStatus,
    heartbeat_deadline,
    names_holder,
)
from flannelpy.errors import ConfigError
from flannelpy.store.etcd.kv import FakeStore
from flannelpy.store.etcd.manager import EtcdSubnetManager
from flannelpy.subnet.keys import status_key
from flannelpy.subnet.lease import LeaseAttrs
from tests.support.agent_fakes import NODE, NODE_IP, PREFIX, AgentHarness, FakeClock
from tests.support.agent_fakes import agent_settings as settings_for

START = 1_700_000_000.0
NEW_IP = "192.168.1.77"
TICK = 2.0
SILENCE = 3 * 300 + 120  # seconds: the default heartbeat rule


def _run(h: AgentHarness, seconds: float) -> None:
    """The agent's status ticks for ``seconds``: it writes its heartbeat as it does."""
    end = h.clock.now + seconds
    while h.clock.now < end:
        h.tick(TICK_STATUS, advance=TICK)


def _record(store: FakeStore) -> NodeStatus:
    kv = store.get(status_key(PREFIX, NODE))
    assert kv is not None, "the old agent wrote no status record"
    return NodeStatus.from_json(kv.value)


@pytest.fixture
def old(tmp_path: Path) -> AgentHarness:
    clock = FakeClock(START)
    h = AgentHarness(tmp_path / "old", store=FakeStore(clock=clock), clock=clock)
    h.start()
    h.drain()
    _run(h, 600)
    return h


def _new_node(old: AgentHarness, tmp_path: Path) -> tuple[EtcdSubnetManager, LeaseAttrs]:
    settings = settings_for(tmp_path / "new")
    manager = EtcdSubnetManager(old.store, settings, clock=old.clock, rng=random.Random(3))
    attrs = LeaseAttrs(public_ip=IPv4Address(NEW_IP), backend_type="vxlan", node_name=NODE)
    return manager, attrs


def test_a_recreated_node_gets_its_subnet_back_once_the_heartbeat_stopped(
    old: AgentHarness, tmp_path: Path
) -> None:
    held = old.writer.state.own[0]
    record = _record(old.store)
    assert (record.public_ip, record.heartbeat_seconds) == (NODE_IP, 300.0)
    # The old machine dies here: no shutdown, nothing released, no more heartbeats.
    new, attrs = _new_node(old, tmp_path)
    old.clock.advance(300)  # a heartbeat may just be late: still refused, saying until when
    with pytest.raises(ConfigError, match="start this node again after 2023-11-14 22:"):
        new.acquire_lease(attrs, None)
    old.clock.now = record.at + SILENCE + 1
    took = new.acquire_lease(attrs, None)
    assert took.subnet == held.subnet and took.attrs.public_ip == IPv4Address(NEW_IP)
    # Its etcd lease had almost a day left: before, the new node was refused until then.
    assert held.store_lease_id is not None
    remaining = old.store.lease_remaining(held.store_lease_id)
    assert remaining is None or remaining > 22 * 3600


def test_two_live_nodes_with_one_name_are_still_refused(old: AgentHarness, tmp_path: Path) -> None:
    new, attrs = _new_node(old, tmp_path)
    for _ in range(12):  # an hour: far past the silence that would prove it gone
        _run(old, 300)
        with pytest.raises(ConfigError, match=f"already used by the live node at {NODE_IP}"):
            new.acquire_lease(attrs, None)
    assert old.writer.state.own[0].attrs.public_ip == IPv4Address(NODE_IP)


TEMPLATE = NodeStatus(
    node=NODE,
    at=START,
    ready=True,
    public_ip=NODE_IP,
    underlay_networks=(),
    backend=BackendSummary(type="vxlan", vni=1, port=0, direct_routing=False, mtu=1450),
    vtep=True,
    applied_generation=None,
)


def _status(**fields: Any) -> NodeStatus:
    return replace(TEMPLATE, **fields)


@pytest.mark.parametrize(
    ("record", "interval", "deadline"),
    [
        (_status(heartbeat_seconds=300.0), 60.0, START + 3 * 300 + 120),  # the holder's own
        (_status(heartbeat_seconds=3600.0), 300.0, START + 3 * 3600 + 120),
        (_status(), 120.0, START + 3 * 120 + 120),  # an older agent: the reader's interval
    ],
)
def test_the_deadline_counts_the_writers_heartbeat(
    record: NodeStatus, interval: float, deadline: float
) -> None:
    assert heartbeat_deadline(record, interval) == deadline
    assert NodeStatus.from_json(record.to_json()) == record


def test_only_the_holders_own_record_counts() -> None:
    record = _status()
    assert names_holder(record, IPv4Address(NODE_IP), None)
    assert not names_holder(record, IPv4Address(NEW_IP), None)  # another node's record
    v6 = _status(public_ip="None", public_ipv6="fd00::5")
    assert names_holder(v6, None, "fd00::5") and not names_holder(v6, None, "fd00::6")
