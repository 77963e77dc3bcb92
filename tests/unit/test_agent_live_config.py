"""Live config through the agent's event queue: a backend change blocked by the
disruption policy until its window opens, a failed application retried, and what was
applied remembered on disk."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from flannelpy.agent.events import TICK_CONTROL
from flannelpy.agent.live_config import (
    APPLIED_FILE,
    BLOCKED_RECHECK_SECONDS,
    CONTROL_RETRY_SECONDS,
    load_applied,
)
from flannelpy.agent.planning import LINGER_SECONDS
from flannelpy.control.records import ForceRecord, NodeOverride, NodeStatus
from flannelpy.store.etcd.config import put_network_config
from flannelpy.subnet.keys import override_key, status_key
from tests.support.agent_fakes import NODE, PREFIX, AgentHarness, FakeClock, net_conf

# 2023-11-14 22:13:20 UTC, a Tuesday; the window below opens at 23:00 that day.
START = 1_700_000_000.0
WINDOW = {
    "Mode": "AllowDuringMaintenanceWindow",
    "Window": {"Days": ["Tue"], "Start": "23:00", "Duration": "1h", "UTCOffset": "+00:00"},
}


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[AgentHarness]:
    harness = AgentHarness(tmp_path, clock=FakeClock(START))
    harness.start()
    harness.drain()  # the control watch's first snapshot: nothing to change
    yield harness
    harness.stop()


def published(h: AgentHarness) -> NodeStatus:
    kv = h.store.get(status_key(PREFIX, NODE))
    assert kv is not None, "no status record in the store"
    return NodeStatus.from_json(kv.value)


def own_lease_backend(h: AgentHarness) -> str:
    leases, _ = h.manager.list_leases()
    (mine,) = [x for x in leases.values() if x.attrs.public_ip == h.writer.state.ctx.public_ip]
    return mine.attrs.backend_type


def change_config(h: AgentHarness, backend: dict[str, Any], **extra: Any) -> None:
    put_network_config(h.store, PREFIX, net_conf(backend, **extra))
    h.deliver_control()


def test_change_blocked_by_the_policy_applies_when_its_window_opens(agent: AgentHarness) -> None:
    assert datetime.fromtimestamp(START, UTC).strftime("%a %H:%M") == "Tue 22:13"
    change_config(agent, {"Type": "host-gw"}, DisruptionPolicy=WINDOW)

    state = agent.writer.state
    assert state.backend.type_name == "vxlan", "blocked: the node keeps what it runs"
    assert state.blocked is not None and "host-gw" in state.blocked.change
    status = agent.status()
    assert [b["change"] for b in status["blocked"]] == [state.blocked.change]
    assert published(agent).blocked is not None
    assert own_lease_backend(agent) == "vxlan"
    assert not (Path(agent.settings.state_dir) / APPLIED_FILE).exists()

    # Rechecks before the window opens change nothing.
    agent.tick(TICK_CONTROL, advance=BLOCKED_RECHECK_SECONDS)
    assert state.backend.type_name == "vxlan" and state.blocked is not None

    # Into the window: the next recheck applies it.
    agent.clock.now = datetime(2023, 11, 14, 23, 0, 5, tzinfo=UTC).timestamp()
    agent.tick(TICK_CONTROL, advance=BLOCKED_RECHECK_SECONDS)
    assert state.backend.type_name == "host-gw"
    assert state.blocked is None
    assert own_lease_backend(agent) == "host-gw"
    assert agent.status()["backend"] == "host-gw" and agent.status()["blocked"] == []
    assert published(agent).blocked is None
    applied = load_applied(agent.settings.state_dir)
    assert applied is not None and applied.backend == {"Type": "host-gw"}
    # The vxlan device is ours and no longer planned: once its linger is over, the
    # reconciler removes it.
    agent.tick(TICK_CONTROL, advance=LINGER_SECONDS)
    agent.reconcile()
    assert "flannel.1" not in {link.name for link in agent.kernel.state.links}


def test_a_rollouts_rollback_applies_outside_the_window_and_is_recorded(
    agent: AgentHarness,
) -> None:
    """The override a rollout writes to roll this node back, met outside the window with
    no active rollout to vouch for it (a Kubernetes-mode agent never reads the rollout
    record): it applies, and the node records it as it records an emergency override."""
    from flannelpy.rollout.driver import override_for
    from flannelpy.rollout.record import RolloutRecord
    from flannelpy.rollout.steps import RollBack
    from flannelpy.subnet.keys import events_prefix

    change_config(agent, {"Type": "host-gw"})  # the step forward, applied in its window
    assert agent.writer.state.backend.type_name == "host-gw"
    change_config(agent, {"Type": "host-gw"}, DisruptionPolicy=WINDOW)  # now outside it
    record = RolloutRecord("r-1", "failed", {"Type": "host-gw"}, None, (), "", "")
    now = datetime.fromtimestamp(agent.clock.now, UTC)
    failed = RollBack(NODE, {"Type": "vxlan"}, 2, f"{NODE} failed verification after 90 s")
    override = override_for(record, failed, now)
    agent.store.put(override_key(PREFIX, NODE), override.to_json().encode())
    agent.deliver_control()

    state = agent.writer.state
    assert state.backend.type_name == "vxlan" and state.blocked is None
    assert state.applied_generation == 2 and published(agent).applied_generation == 2
    events, _ = agent.store.get_prefix(events_prefix(PREFIX))
    (event,) = [json.loads(kv.value) for kv in events]
    assert event["Node"] == NODE and event["Change"].startswith("backend host-gw -> vxlan")
    assert event["Reason"] == f"rollback by rollout r-1: {NODE} failed verification after 90 s"


def test_a_failed_application_is_retried(agent: AgentHarness) -> None:
    class Boom(RuntimeError):
        pass

    calls: list[str] = []

    def record_forced(node: str, change: str, force: ForceRecord) -> None:
        calls.append(change)
        if len(calls) == 1:
            raise Boom("the store client broke")

    agent.control.record_forced = record_forced  # type: ignore[method-assign]
    override = NodeOverride(
        backend={"Type": "host-gw"},
        generation=3,
        force=ForceRecord(reason="test", by="me", at="2023-11-14T22:00:00Z"),
    )
    agent.store.put(override_key(PREFIX, NODE), override.to_json().encode())
    put_network_config(agent.store, PREFIX, net_conf(DisruptionPolicy={"Mode": "Block"}))
    agent.deliver_control()

    state = agent.writer.state
    assert len(calls) == 1
    assert state.backend.type_name == "vxlan", "the failed change left the node as it was"
    assert agent.writer.live.failed

    agent.tick(TICK_CONTROL, advance=CONTROL_RETRY_SECONDS - 1)
    assert len(calls) == 1, "retried before the retry interval"

    agent.tick(TICK_CONTROL, advance=1)
    assert len(calls) == 2
    assert state.backend.type_name == "host-gw"
    assert state.applied_generation == 3
    assert not agent.writer.live.failed
    doc = json.loads((Path(agent.settings.state_dir) / APPLIED_FILE).read_text())
    assert doc == {"Backend": {"Type": "host-gw"}, "Generation": 3}
    assert published(agent).applied_generation == 3


def test_an_unchanged_config_changes_nothing(agent: AgentHarness) -> None:
    before = len(agent.kernel.applied)
    agent.deliver_control()
    agent.deliver_control()
    assert agent.writer.counts.events()["control"] == 3  # the watch's first, then these two
    assert agent.writer.state.backend.type_name == "vxlan"
    assert agent.writer.state.applied_generation is None
    agent.reconcile()
    assert len(agent.kernel.applied) == before


def test_a_change_that_fails_after_the_backend_switch_is_completed_on_retry(
    agent: AgentHarness,
) -> None:
    """The synchronous reconcile raises after the in-memory switch: the retry re-runs
    every step until the lease and applied-backend.json carry the new backend."""
    reconciler = agent.writer.reconciler
    real = reconciler.reconcile_once
    failures = [RuntimeError("netlink socket closed"), RuntimeError("netlink socket closed")]

    def flaky(reason: str = "requested") -> Any:
        if reason == "config change" and failures:
            raise failures.pop(0)
        return real(reason)

    reconciler.reconcile_once = flaky  # type: ignore[method-assign]
    change_config(agent, {"Type": "host-gw"})

    state = agent.writer.state
    applied = Path(agent.settings.state_dir) / APPLIED_FILE
    assert agent.writer.live.failed
    assert not applied.exists()

    agent.tick(TICK_CONTROL, advance=CONTROL_RETRY_SECONDS)
    assert agent.writer.live.failed, "the second try fails too"
    assert not applied.exists()

    agent.tick(TICK_CONTROL, advance=CONTROL_RETRY_SECONDS)
    assert not agent.writer.live.failed
    assert state.backend.type_name == "host-gw"
    assert own_lease_backend(agent) == "host-gw"
    assert json.loads(applied.read_text()) == {"Backend": {"Type": "host-gw"}, "Generation": 0}
    assert agent.status()["backend"] == "host-gw"

    # Done: later retries and snapshots change nothing more.
    before = len(agent.kernel.applied)
    agent.tick(TICK_CONTROL, advance=CONTROL_RETRY_SECONDS)
    agent.deliver_control()
    assert len(agent.kernel.applied) == before


def test_applied_state_waits_for_the_lease_to_carry_the_new_backend(agent: AgentHarness) -> None:
    """The store refuses the lease rewrite (and the follow-up's retry): nothing records
    the change as applied until our lease advertises it."""
    agent.manager.fail_renewals = 2
    change_config(agent, {"Type": "host-gw"})
    applied = Path(agent.settings.state_dir) / APPLIED_FILE
    assert own_lease_backend(agent) == "vxlan"
    assert not applied.exists() and agent.writer.live.failed

    agent.tick(TICK_CONTROL, advance=CONTROL_RETRY_SECONDS)
    assert own_lease_backend(agent) == "host-gw"
    assert json.loads(applied.read_text())["Backend"] == {"Type": "host-gw"}
    assert not agent.writer.live.failed


def test_a_newer_change_replaces_one_that_keeps_failing(agent: AgentHarness) -> None:
    """host-gw cannot be programmed here; the operator reverts to vxlan: the revert is
    applied, not stuck behind the change it replaces."""
    reconciler = agent.writer.reconciler
    real = reconciler.reconcile_once
    state = agent.writer.state

    def refuse_host_gw(reason: str = "requested") -> Any:
        if reason == "config change" and state.backend.type_name == "host-gw":
            raise RuntimeError("host-gw routes refused")
        return real(reason)

    reconciler.reconcile_once = refuse_host_gw  # type: ignore[method-assign]
    change_config(agent, {"Type": "host-gw"})
    agent.tick(TICK_CONTROL, advance=CONTROL_RETRY_SECONDS)
    assert agent.writer.live.failed and state.backend.type_name == "host-gw"

    change_config(agent, {"Type": "vxlan"})
    assert not agent.writer.live.failed
    assert state.backend.type_name == "vxlan" and own_lease_backend(agent) == "vxlan"
    doc = json.loads((Path(agent.settings.state_dir) / APPLIED_FILE).read_text())
    assert doc["Backend"] == {"Type": "vxlan"}


def test_enabling_ipv6_live_is_refused_until_a_restart(
    agent: AgentHarness, caplog: pytest.LogCaptureFixture
) -> None:
    before = len(agent.kernel.applied)
    with caplog.at_level("WARNING"):
        change_config(agent, {"Type": "host-gw"}, EnableIPv6=True, IPv6Network="fd00::/56")
        agent.reconcile()
    assert "EnableIPv6 or IPv6Network changed; restart the agent to apply it" in caplog.text
    assert agent.writer.state.backend.type_name == "vxlan"  # nothing of the change applied
    assert not agent.writer.state.config.enable_ipv6
    assert len(agent.kernel.applied) == before


def test_a_vtep_that_leaves_the_plan_lingers_before_it_is_removed(agent: AgentHarness) -> None:
    """A switch to host-gw with no vxlan peer: the VTEP leaves the plan, but stays for
    LINGER_SECONDS so a peer that has not seen our new lease still reaches us through it."""

    def vteps() -> list[str]:
        return [link.name for link in agent.kernel.state.links if link.name == "flannel.1"]

    assert vteps() == ["flannel.1"]
    assert [a for a in agent.kernel.state.addresses if a.ifname == "flannel.1"]
    change_config(agent, {"Type": "host-gw"})
    assert agent.writer.state.backend.type_name == "host-gw"
    agent.reconcile()
    assert vteps() == ["flannel.1"], "removed at once: peers still encapsulating lose packets"
    state = agent.kernel.state  # the device stays bare: no address, neighbour or FDB entry
    assert not [a for a in state.addresses if a.ifname == "flannel.1"], state.addresses
    assert not [f for f in state.fdb if f.ifname == "flannel.1"], state.fdb
    assert own_lease_backend(agent) == "host-gw"

    agent.clock.advance(LINGER_SECONDS - 0.5)
    agent.writer.settle()
    agent.reconcile()
    assert vteps() == ["flannel.1"]

    agent.clock.advance(1.0)
    assert agent.writer.pending(), "the idle writer loop must wake for the removal"
    agent.writer.settle()
    agent.reconcile()
    assert vteps() == []
