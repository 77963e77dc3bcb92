"""The agent's own leases, driven through its event queue on the fake store and clock:
start-up, a lease lost and recovered (also while the store is away), renewal with
retry, and adoption of a lease held before a restart."""

from __future__ import annotations

from collections.abc import Iterator
from ipaddress import IPv4Network
from pathlib import Path

import pytest

from flannelpy.agent.events import TICK_RENEW, TICK_STATUS, LeasesChanged
from flannelpy.agent.leases import RENEW_RETRY_SECONDS
from flannelpy.errors import StoreUnavailable
from flannelpy.store.etcd.config import put_network_config
from flannelpy.subnet.keys import lease_key
from flannelpy.subnet.lease import Lease
from tests.support.agent_fakes import NODE_IP, PREFIX, AgentHarness, net_conf


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[AgentHarness]:
    harness = AgentHarness(tmp_path)
    harness.start()
    yield harness
    harness.stop()


def store_holder(h: AgentHarness, subnet: object) -> str | None:
    """The PublicIP the store's lease for ``subnet`` advertises (None: no such lease)."""
    leases, _ = h.manager.list_leases()
    found = [x for x in leases.values() if x.subnet == subnet]
    return str(found[0].attrs.public_ip) if found else None


def delete_lease(h: AgentHarness, subnet: IPv4Network) -> None:
    key = lease_key(PREFIX, subnet)
    kv = h.store.get(key)
    assert kv is not None
    assert h.store.delete_if_mod_revision(key, kv.mod_revision)


def test_start_acquires_programs_and_reports_ready(agent: AgentHarness) -> None:
    (subnet,) = agent.own_subnets()
    assert store_holder(agent, subnet) == NODE_IP
    assert agent.agent.ready
    env = Path(agent.settings.subnet_file).read_text()
    assert f"FLANNEL_SUBNET={subnet.network_address + 1}/24" in env
    status = agent.status()
    assert status["ready"] is True and status["lease"] == str(subnet)
    assert status["events"]["leases"] == 1  # the first snapshot, handled during start
    assert status["capacity_checks"] == 1
    # The start reconcile created the VTEP device and the bridge got the gateway.
    assert {link.name for link in agent.kernel.state.links} == {"flannel.1"}
    assert agent.pods is not None and agent.pods.started


def test_lost_lease_is_reacquired_with_the_same_subnet(agent: AgentHarness) -> None:
    (subnet,) = agent.own_subnets()
    delete_lease(agent, subnet)
    assert store_holder(agent, subnet) is None

    agent.deliver_leases()  # the watch's batch, then the LeaseLost it raises

    assert store_holder(agent, subnet) == NODE_IP
    assert agent.own_subnets() == [subnet]
    events = agent.writer.counts.events()
    assert events["leases"] == 2 and events["lease_lost"] == 1
    assert not agent.writer.state.lease_lost


def test_recovery_waits_out_a_store_outage(agent: AgentHarness) -> None:
    (subnet,) = agent.own_subnets()
    delete_lease(agent, subnet)
    leases, revision = agent.manager.list_leases()
    agent.store.set_available(False)
    agent.put(LeasesChanged(leases, revision))
    agent.drain()
    assert agent.writer.state.lease_lost, "a failed re-acquire stays due"

    agent.store.set_available(True)
    agent.tick(TICK_STATUS, advance=0.5)  # still inside the retry pause
    assert store_holder(agent, subnet) is None
    agent.tick(TICK_STATUS, advance=0.6)
    assert store_holder(agent, subnet) == NODE_IP
    assert not agent.writer.state.lease_lost
    assert agent.writer.counts.events()["lease_lost"] == 1


def test_renewal_is_retried_a_minute_after_a_failure(agent: AgentHarness) -> None:
    (lease,) = agent.writer.state.own
    assert lease.expiration is not None
    margin = agent.settings.subnet_lease_renew_margin * 60.0
    agent.tick(TICK_RENEW, advance=lease.expiration - margin - agent.clock.now - 10)
    assert agent.writer.state.own[0].expiration == lease.expiration, "not due yet"

    agent.manager.fail_renewals = 1
    agent.tick(TICK_RENEW, advance=10)
    assert agent.writer.state.own[0].expiration == lease.expiration, "the renewal failed"
    agent.tick(TICK_RENEW, advance=RENEW_RETRY_SECONDS - 1)
    assert agent.writer.state.own[0].expiration == lease.expiration, "retried too early"

    agent.tick(TICK_RENEW, advance=1)
    renewed = agent.writer.state.own[0]
    assert renewed.expiration is not None and renewed.expiration > lease.expiration
    assert agent.writer.counts.events()["tick"] == 4


def test_a_lease_held_before_a_restart_is_adopted(tmp_path: Path) -> None:
    first = AgentHarness(tmp_path / "a")
    first.start()
    (subnet,) = first.own_subnets()
    first.stop()
    # A second lease of this node, as warm capacity would have left it.
    extra = first.manager.create_lease(first.writer.leases.attrs(), first.writer.state.pools, None)
    Path(first.settings.subnet_file).unlink()

    again = AgentHarness(tmp_path / "b", store=first.store, clock=first.clock)
    again.start()
    try:
        assert set(again.own_subnets()) == {subnet, extra.subnet}
        assert again.pods is not None
        assert {str(g.network) for g in again.pods.gateways} == {str(subnet), str(extra.subnet)}
    finally:
        again.stop()


def test_lease_key_layout_is_flannels(agent: AgentHarness) -> None:
    (subnet,) = agent.own_subnets()
    assert agent.store.get(lease_key(PREFIX, subnet)) is not None


def test_a_renewal_after_a_lost_rewrite_reply_keeps_the_new_attributes(tmp_path: Path) -> None:
    agent = AgentHarness(tmp_path)
    agent.start()
    agent.drain()
    manager = agent.manager
    written: list[str] = []
    lose = [2]
    real = type(manager).renew_lease

    def renew(lease: Lease) -> Lease:
        renewed = real(manager, lease)  # the write reaches the store...
        written.append(lease.attrs.backend_type)
        if lease.attrs.backend_type == "host-gw" and lose[0]:
            lose[0] -= 1
            raise StoreUnavailable("injected: the reply was lost")  # ...its reply does not
        return renewed

    manager.renew_lease = renew  # type: ignore[method-assign]
    put_network_config(agent.store, PREFIX, net_conf({"Type": "host-gw"}))
    agent.deliver_control()
    assert written == ["host-gw", "host-gw"]
    (lease,) = agent.writer.state.own
    assert lease.expiration is not None
    agent.tick(TICK_RENEW, advance=lease.expiration - agent.clock.now)
    assert "vxlan" not in written, f"old attributes written back: {written}"
    agent.stop()
