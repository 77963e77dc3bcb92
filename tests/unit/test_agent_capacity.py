"""Warm capacity through the agent's event queue: IPAM's low-free warning becomes a
capacity event and a second lease; an emptied surplus lease goes after its hold-down."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from flannelpy.agent import capacity as capacity_module
from flannelpy.agent.capacity import CAPACITY_TICK
from flannelpy.agent.events import TICK_CAPACITY, TICK_STATUS
from flannelpy.subnet.keys import lease_key
from tests.support.agent_fakes import NODE_IP, PREFIX, AgentHarness, net_conf
from tests.support.fakes import lease

# /28 leases: 14 addresses, of which the gateway takes one.
CONFIG = net_conf(SubnetLen=28, MinFreeAddresses=4, MaxLeasesPerNode=2, LeaseHoldDownSeconds=60)


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[AgentHarness]:
    harness = AgentHarness(tmp_path, config=CONFIG)
    harness.start()
    harness.drain()
    yield harness
    harness.stop()


def store_subnets(h: AgentHarness) -> set[str]:
    leases, _ = h.manager.list_leases()
    return {str(x.subnet) for x in leases.values() if str(x.attrs.public_ip) == NODE_IP}


def test_low_free_adds_a_lease(agent: AgentHarness) -> None:
    assert agent.pods is not None
    (first,) = agent.own_subnets()
    checks = agent.writer.counts.capacity_checks

    # Ticks alone: capacity is evaluated, nothing is added.
    agent.tick(TICK_CAPACITY, advance=CAPACITY_TICK)
    assert agent.writer.counts.capacity_checks == checks + 1
    assert agent.own_subnets() == [first]

    free = agent.pods.ipam.usage()[0].free
    for i in range(free - 3):  # leaves 3 free: below MinFreeAddresses
        agent.pods.add_pod(f"pod-{i}")
    assert agent.writer.queue.qsize() == 1, "IPAM's warning is only an event"
    assert agent.own_subnets() == [first], "nothing acts before the writer handles it"

    agent.drain()

    subnets = agent.own_subnets()
    assert len(subnets) == 2 and subnets[0] == first
    assert store_subnets(agent) == {str(s) for s in subnets}
    assert agent.writer.counts.events()["capacity"] == 1
    assert agent.writer.counts.capacity_checks == checks + 2
    agent.tick(TICK_STATUS)  # status.json follows on the status timer
    status = agent.status()
    assert status["leases"] == [str(s) for s in subnets]
    assert status["events"]["capacity"] == 1
    # IPAM serves the new lease and the bridge carries its gateway.
    assert [u.subnet for u in agent.pods.ipam.usage()] == subnets
    assert str(subnets[1].network_address + 1) in {str(g.ip) for g in agent.pods.gateways}


def test_an_emptied_surplus_lease_is_released_after_its_hold_down(agent: AgentHarness) -> None:
    assert agent.pods is not None
    free = agent.pods.ipam.usage()[0].free
    pods = [f"pod-{i}" for i in range(free - 3)]
    for pod in pods:
        agent.pods.add_pod(pod)
    agent.drain()
    first, second = agent.own_subnets()

    for pod in pods:
        agent.pods.ipam.release(pod, "eth0")
    agent.tick(TICK_CAPACITY, advance=CAPACITY_TICK)  # empty since now
    assert agent.own_subnets() == [first, second]
    agent.tick(TICK_CAPACITY, advance=30)
    assert agent.own_subnets() == [first, second], "released before the hold-down"

    agent.tick(TICK_CAPACITY, advance=31)
    assert len(agent.own_subnets()) == 1
    assert len(store_subnets(agent)) == 1
    agent.tick(TICK_STATUS)
    assert agent.status()["leases"] == [str(s) for s in agent.own_subnets()]


# --- both families (issue 31) ----------------------------------------------------------

# IPv6 /124 leases: 13 pod addresses, so IPv6 runs low long before IPv4's /24.
WARM6: dict[str, object] = {
    "EnableIPv6": True,
    "IPv6Network": "fd00:10::/56",
    "IPv6SubnetLen": 124,
    "MinFreeAddresses": 4,
    "MaxLeasesPerNode": 2,
    "LeaseHoldDownSeconds": 60,
}
DUAL = net_conf(**WARM6)
IPV6_ONLY = net_conf(EnableIPv4=False, **WARM6)


@pytest.mark.parametrize("config", [DUAL, IPV6_ONLY], ids=["dual-stack", "ipv6-only"])
def test_a_node_low_on_ipv6_addresses_adds_a_lease(tmp_path: Path, config: str) -> None:
    h = AgentHarness(tmp_path, config=config)
    h.start()
    h.drain()
    try:
        assert h.pods is not None
        (first,) = h.writer.state.own
        assert first.ipv6_subnet is not None
        for i in range(13 - 3):  # leaves 3 free IPv6 addresses; IPv4 keeps 243
            h.pods.ipam.allocate(f"pod-{i}", "eth0", family=6)
        h.drain()
        own = h.writer.state.own
        assert len(own) == 2 and own[0] == first
        second = own[1]
        assert second.ipv6_subnet is not None and second.ipv6_subnet.prefixlen == 124
        assert (second.subnet is None) == (config == IPV6_ONLY)
        usage = {u.subnet: u.free for u in h.pods.ipam.usage()}
        assert usage[second.ipv6_subnet] == 13 and usage[first.ipv6_subnet] == 3
        # Released as a whole: once its pods are gone and the hold-down has passed.
        for i in range(13 - 3):
            h.pods.ipam.release(f"pod-{i}", "eth0")
        h.tick(TICK_CAPACITY, advance=CAPACITY_TICK)
        h.tick(TICK_CAPACITY, advance=61)
        assert h.writer.state.own == [first]
        leases, _ = h.manager.list_leases()
        assert [x.ipv6_subnet for x in leases.values()] == [first.ipv6_subnet]
    finally:
        h.stop()


def test_pool_utilisation_follows_the_lease_list_and_is_not_recomputed_without_a_change(
    agent: AgentHarness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pools' utilisation walks every lease of the cluster: a capacity tick with the
    same lease list, config and pools reuses the last figure; a new list is counted."""
    walks: list[int] = []
    real = capacity_module.pool_capacity

    def counted(config: Any, pools: Any, leases: Any) -> Any:
        walks.append(len(leases))
        return real(config, pools, leases)

    monkeypatch.setattr(capacity_module, "pool_capacity", counted)
    registry = agent.writer.metrics.registry

    def utilisation() -> float | None:
        return registry.get_sample_value(
            "flannelpy_pool_utilisation_ratio", {"pool": "10.244.0.0/16"}
        )

    before = utilisation()
    assert before is not None and before > 0
    for _ in range(3):
        agent.tick(TICK_CAPACITY, advance=CAPACITY_TICK)
    assert walks == [], "ticks without a change walked the leases again"

    peer = lease("10.244.9.0/28", "192.0.2.9")
    agent.store.put(lease_key(PREFIX, peer.subnet), peer.attrs.to_json().encode())
    agent.deliver_leases()
    agent.tick(TICK_CAPACITY, advance=CAPACITY_TICK)
    assert walks == [2], "a new lease list is walked once"
    after = utilisation()
    assert after is not None and after == pytest.approx(2 * before)
    agent.tick(TICK_CAPACITY, advance=CAPACITY_TICK)
    assert walks == [2]
