"""The rollout: plan, state machine and driver, over a FakeStore with simulated agents.

Time is fake throughout: ``Clocks.sleep`` advances the rollout's wall clock and its
monotonic clock together, then lets the simulated agents take one round.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from flannelpy.config.netconf import parse_network_config
from flannelpy.control.policy import ALLOW, parse_policy, window_state
from flannelpy.control.records import (
    BackendSummary,
    NodeOverride,
    NodeStatus,
    PeerProbe,
    ProbeSummary,
)
from flannelpy.errors import ConfigError
from flannelpy.rollout.backends import expected_summary, target_backend, with_backend
from flannelpy.rollout.driver import (
    _claim,
    drive,
    make_plan,
    prepare_resume,
    request_stop,
    start,
)
from flannelpy.rollout.plan import plan_rollout
from flannelpy.rollout.record import RolloutRecord, new_record
from flannelpy.rollout.steps import (
    MarkApplied,
    MarkVerified,
    PauseForWindow,
    Resume,
    RollBack,
    Wait,
    WriteOverride,
    next_action,
    record_after,
)
from flannelpy.store.etcd.kv import FakeStore
from flannelpy.store.rollout_etcd import RolloutStore
from flannelpy.subnet.keys import config_key, override_key
from tests.support.rollout_agents import SimCluster, SimNode, config_json, five_nodes

PREFIX = "/t/coreos.com/network"
MONDAY_1AM = datetime(2026, 1, 5, 1, 0, tzinfo=UTC)  # 2026-01-05 is a Monday
VXLAN = {"Type": "vxlan"}
WINDOW = {
    "Mode": "AllowDuringMaintenanceWindow",
    "Window": {"Days": ["Mon", "Tue"], "Start": "02:00", "Duration": "1m", "UTCOffset": "+00:00"},
}


class RecordingStore(FakeStore):
    """A FakeStore that remembers every put, to count override writes."""

    def __init__(self, clock: Callable[[], float]) -> None:
        super().__init__(clock=clock)
        self.puts: list[tuple[str, bytes]] = []

    def put(self, key: str, value: bytes, lease_id: int = 0) -> int:
        self.puts.append((key, value))
        return super().put(key, value, lease_id)


class Clocks:
    def __init__(self, wall: datetime = MONDAY_1AM) -> None:
        self.wall = wall
        self.mono = 0.0
        self.cluster: SimCluster | None = None

    def sleep(self, seconds: float) -> None:
        self.mono += seconds
        self.wall += timedelta(seconds=seconds)
        if self.cluster is not None:
            self.cluster.tick()

    def agent_time(self) -> float:
        return 1_800_000_000.0 + self.mono  # the agents' own clock, unrelated to ``wall``


class Env:
    """A FakeStore holding a config, five simulated agents and the rollout adapter."""

    def __init__(
        self,
        backend: dict[str, Any] | None = None,
        policy: dict[str, Any] | None = None,
        nodes: list[SimNode] | None = None,
        wall: datetime = MONDAY_1AM,
        raw_config: str | None = None,
        kube_mode: bool = False,
    ) -> None:
        self.clocks = Clocks(wall)
        self.store = RecordingStore(clock=lambda: self.clocks.mono)
        self.store.put(
            config_key(PREFIX), (raw_config or config_json(backend or VXLAN, policy)).encode()
        )
        self.sim = SimCluster(
            self.store,
            PREFIX,
            nodes or five_nodes(),
            self.clocks.agent_time,
            lambda: self.clocks.wall,
            kube_mode=kube_mode,
        )
        self.clocks.cluster = self.sim
        self.sim.tick()
        self.rs = RolloutStore(self.store, PREFIX)
        self.lines: list[str] = []

    def start(self, backend: str = "host-gw", timeout: float = 30.0, **kw: Any) -> RolloutRecord:
        force = kw.pop("force", None)
        plan = make_plan(self.rs, backend, self.clocks.wall, **kw)
        return start(self.rs, plan, self.clocks.wall, timeout, force)

    def drive(
        self, record_id: str, display: Callable[[str], None] | None = None, **kw: Any
    ) -> RolloutRecord:
        return drive(
            self.rs,
            record_id,
            lambda: self.clocks.wall,
            self.clocks.sleep,
            display or self.lines.append,
            monotonic=lambda: self.clocks.mono,
            **kw,
        )

    def config(self) -> dict[str, Any]:
        kv = self.store.get(config_key(PREFIX))
        assert kv is not None
        doc: dict[str, Any] = json.loads(kv.value)
        return doc

    def override(self, node: str) -> NodeOverride | None:
        kv = self.store.get(override_key(PREFIX, node))
        return NodeOverride.from_json(kv.value) if kv else None

    def override_puts(self, node: str) -> list[NodeOverride]:
        key = override_key(PREFIX, node)
        return [NodeOverride.from_json(v) for k, v in self.store.puts if k == key]


def statuses(env: Env) -> dict[str, NodeStatus]:
    return env.rs.read_nodes().statuses


# ---------------------------------------------------------------------------
# Targets and the config document
# ---------------------------------------------------------------------------


def test_target_is_the_configs_backend_with_the_given_options_replaced() -> None:
    config = parse_network_config(
        json.dumps(
            {
                "Network": "10.244.0.0/16",
                "backend": {"type": "vxlan", "vni": 4, "Port": 4789, "directrouting": True},
            }
        )
    )
    assert target_backend(config, "host-gw") == {
        "vni": 4,
        "Port": 4789,
        "Type": "host-gw",
        "DirectRouting": False,
    }
    assert target_backend(config, "vxlan", True, vni=7, mtu=9000) == {
        "Port": 4789,
        "Type": "vxlan",
        "DirectRouting": True,
        "VNI": 7,
        "MTU": 9000,
    }


def test_with_backend_keeps_every_other_key_and_the_backend_spelling_in_place() -> None:
    doc = {
        "Network": "10.244.0.0/16",
        "backend": {"Type": "vxlan"},
        "SubnetLen": 25,
        "DisruptionPolicy": {"Mode": "Block"},
    }
    out = with_backend(doc, {"Type": "host-gw"})
    assert list(out) == ["Network", "backend", "SubnetLen", "DisruptionPolicy"]
    assert out["backend"] == {"Type": "host-gw"} and out["SubnetLen"] == 25


def test_an_invalid_target_is_refused_by_net_confs_parser() -> None:
    env = Env()
    with pytest.raises(ConfigError, match='"VNI" 16777216 is out of range'):
        make_plan(env.rs, "vxlan", MONDAY_1AM, vni=1 << 24)
    with pytest.raises(ConfigError, match="not a known backend"):
        make_plan(env.rs, "ipvlan", MONDAY_1AM)


def test_final_config_write_replaces_only_the_backend() -> None:
    raw = (
        '{\n  "Network": "10.244.0.0/16",\n  "backend": {"type": "vxlan", "VNI": 3},\n'
        '  "SubnetLen": 25,\n  "DisruptionPolicy": {"Mode": "Allow"}\n}\n'
    )
    env = Env(raw_config=raw)
    env.rs.write_config_backend({"Type": "host-gw", "VNI": 3})
    doc = env.config()
    assert doc == {
        "Network": "10.244.0.0/16",
        "backend": {"Type": "host-gw", "VNI": 3},
        "SubnetLen": 25,
        "DisruptionPolicy": {"Mode": "Allow"},
    }
    assert parse_network_config(json.dumps(doc)).backend.type == "host-gw"


# ---------------------------------------------------------------------------
# The plan
# ---------------------------------------------------------------------------


def test_plan_lists_order_transitions_mtu_and_policy() -> None:
    env = Env()
    plan = make_plan(env.rs, "host-gw", MONDAY_1AM, order=["n3", "n1", "n2", "n4", "n5"])
    assert plan.problems == ()
    assert [s.node for s in plan.steps] == ["n3", "n1", "n2", "n4", "n5"]
    assert {s.transition for s in plan.steps} == {"vxlan (MTU 1450) -> host-gw (MTU 1500)"}
    text = "\n".join(plan.lines())
    assert "1450 -> 1500; pods that exist keep MTU 1450 until they are re-created" in text
    assert "policy: Allow: proceeds now" in text


def test_plan_of_host_gw_across_two_segments_names_every_pair_without_a_path() -> None:
    env = Env(nodes=five_nodes(two_segments=True))
    plan = make_plan(env.rs, "host-gw", MONDAY_1AM)
    # Mixed states keep working (host-gw nodes keep a VTEP while a peer is vxlan); the
    # final state does not: every pair across the two segments.
    assert len(plan.problems) == 6
    assert plan.problems[0].startswith(
        "host-gw cannot work: n1 (100.64.0.2) and n4 (100.64.1.5): the nodes are on "
        "different L2 segments"
    )
    assert "use vxlan, or vxlan with DirectRouting" in plan.problems[0]
    assert make_plan(env.rs, "vxlan", MONDAY_1AM, direct_routing=True).problems == ()


def test_plan_finds_a_pair_cut_off_in_an_intermediate_state() -> None:
    env = Env(nodes=five_nodes(two_segments=True))
    plan = make_plan(env.rs, "vxlan", MONDAY_1AM, vni=2)
    # After n1 alone moves to VNI 2 it shares no path with any node still on VNI 1 (plain
    # vxlan encapsulates even on one segment); the final state is fine.
    first = [p for p in plan.problems if p.startswith("switching n1 (1 of 5)")]
    assert [p.split(" without")[0] for p in first] == [
        f"switching n1 (1 of 5) would leave n1 (100.64.0.2) and {peer}"
        for peer in ("n2 (100.64.0.3)", "n3 (100.64.0.4)", "n4 (100.64.1.5)", "n5 (100.64.1.6)")
    ]
    assert "different VNIs (1 and 2)" in first[0]
    assert not any(p.startswith("vxlan cannot work") for p in plan.problems)
    # With DirectRouting, same-segment pairs route directly; cross-segment ones still break.
    plan = make_plan(env.rs, "vxlan", MONDAY_1AM, direct_routing=True, vni=2)
    assert plan.problems and all("n4" in p or "n5" in p for p in plan.problems)


def test_plan_problems_for_nodes_and_order() -> None:
    env = Env()
    env.sim.node("n2").ready = False
    env.sim.tick()
    plan = make_plan(env.rs, "host-gw", MONDAY_1AM, order=["n1", "n9", "n1", "n3"])
    assert plan.problems[:2] == (
        "node n9 reports no status in the store; start its agent, or leave it out of --nodes",
        "--nodes names n1 twice; name each node once",
    )
    assert "node n2 is not Ready; fix it (flannelpy doctor) first" in plan.problems
    assert any(p.startswith("--nodes leaves out n2, n4, n5") for p in plan.problems)
    with pytest.raises(ConfigError, match="n9 reports no status"):
        start(env.rs, plan, MONDAY_1AM)


def test_plan_skips_nodes_already_on_the_target() -> None:
    env = Env()
    env.rs.write_override("n2", NodeOverride({"Type": "host-gw"}, 4))
    env.sim.tick()
    plan = make_plan(env.rs, "host-gw", MONDAY_1AM)
    assert [s.node for s in plan.to_switch] == ["n1", "n3", "n4", "n5"]
    assert plan.steps[1].transition == "host-gw (MTU 1500): already the target"


def test_plan_without_statuses_is_refused() -> None:
    store = FakeStore()
    store.put(config_key(PREFIX), config_json(VXLAN).encode())
    plan = make_plan(RolloutStore(store, PREFIX), "host-gw", MONDAY_1AM)
    assert plan.problems and plan.problems[0].startswith("no node reports a status")


def test_plan_policy_lines() -> None:
    env = Env(policy={"Mode": "Block"})
    plan = make_plan(env.rs, "host-gw", MONDAY_1AM)
    assert plan.blocked is not None
    assert "blocked by DisruptionPolicy Block" in plan.blocked
    with pytest.raises(ConfigError, match="blocked by DisruptionPolicy Block"):
        start(env.rs, plan, MONDAY_1AM)
    assert make_plan(env.rs, "vxlan", MONDAY_1AM, direct_routing=True).policy_line == (
        "Block: does not apply (no disruptive change)"
    )
    forced = make_plan(env.rs, "host-gw", MONDAY_1AM, force_reason="incident 42")
    assert forced.blocked is None and "--force (reason: incident 42)" in forced.policy_line
    env = Env(policy=WINDOW)
    line = make_plan(env.rs, "host-gw", MONDAY_1AM).policy_line
    assert line.endswith("outside the window: waits until 2026-01-05T02:00:00+00:00")
    line = make_plan(env.rs, "host-gw", MONDAY_1AM + timedelta(hours=1)).policy_line
    assert "inside the window until 2026-01-05T02:01:00+00:00: starts now" in line


# ---------------------------------------------------------------------------
# next_action on its own
# ---------------------------------------------------------------------------


def _status(
    node: str,
    gen: int | None,
    applied_at: float,
    backend: str = "host-gw",
    probes: dict[str, PeerProbe] | None = None,
    subnet: str = "",
) -> NodeStatus:
    mtu = 1500 if backend == "host-gw" else 1450
    return NodeStatus(
        node,
        applied_at + 1,
        True,
        "100.64.0.2",
        ("100.64.0.0/24",),
        BackendSummary(backend, 1, 8472, False, mtu),
        True,
        gen,
        applied_at,
        subnets=(subnet,),
        probes=ProbeSummary.of(probes or {}),
    )


def _record(env: Env) -> RolloutRecord:
    record, _ = env.rs.read_record()
    assert record is not None
    return record


def first_write(env: Env) -> tuple[RolloutRecord, WriteOverride, RolloutRecord]:
    """A rollout started, its first step (n1's override) and the record that step makes."""
    record = env.start()
    snap = env.rs.read_nodes()
    action = next_action(record, snap.statuses, ALLOW, MONDAY_1AM, 0.0, snap.overrides)
    assert action == WriteOverride("n1", record.target, 1)
    return record, action, record_after(record, action, MONDAY_1AM, None)


def test_a_killed_driver_never_writes_a_second_generation_for_one_step() -> None:
    env = Env()
    record, _, recorded = first_write(env)
    snap = env.rs.read_nodes()
    assert recorded.entry("n1").state == "applying"
    # Killed before the override was written: the same generation is written again.
    again = next_action(recorded, snap.statuses, ALLOW, MONDAY_1AM, 5.0, snap.overrides)
    assert again == WriteOverride("n1", record.target, 1)
    assert record_after(recorded, again, MONDAY_1AM, None) == recorded
    # Killed after it was written: only waiting is left.
    env.rs.write_override("n1", NodeOverride(record.target, 1, rollout=record.id))
    snap = env.rs.read_nodes()
    waiting = next_action(recorded, snap.statuses, ALLOW, MONDAY_1AM, 5.0, snap.overrides)
    assert isinstance(waiting, Wait)


def test_verification_needs_fresh_good_probes_both_ways() -> None:
    env = Env()
    record = env.start()
    entry = replace(record.entry("n1"), state="verifying", generation=1, applied_at=100.0)
    record = record.with_entry(entry)
    good = PeerProbe(True, True, True, 3, 101.0)
    stale = PeerProbe(True, True, True, 2, 99.0)
    sts = {
        "n1": _status("n1", 1, 100.0, probes={"10.244.2.0/24": good}, subnet="10.244.1.0/24"),
        "n2": _status(
            "n2", None, 10.0, "vxlan", probes={"10.244.1.0/24": stale}, subnet="10.244.2.0/24"
        ),
    }
    action = next_action(record, sts, ALLOW, MONDAY_1AM, 5.0)
    assert isinstance(action, Wait) and "n2 -> n1: no probe round since the change" in action.detail
    lost = PeerProbe(True, False, False, 3, 102.0)
    sts["n2"] = replace(sts["n2"], probes=ProbeSummary.of({"10.244.1.0/24": lost}))
    action = next_action(record, sts, ALLOW, MONDAY_1AM, 31.0)
    assert isinstance(action, RollBack)
    assert action.reason == (
        "n1 failed verification after 30 s: n2 -> n1: the full-MTU probe was lost"
    )
    assert action.backend == {"Type": "vxlan"} and action.generation == 2
    sts["n2"] = replace(sts["n2"], probes=ProbeSummary.of({"10.244.1.0/24": good}))
    assert next_action(record, sts, ALLOW, MONDAY_1AM, 31.0) == MarkVerified("n1")


def test_applied_means_the_generation_ready_and_the_target_backend() -> None:
    env = Env()
    record = env.start()
    record = record_after(record, WriteOverride("n1", record.target, 1), MONDAY_1AM, None)
    sts = {"n1": _status("n1", 1, 50.0, backend="vxlan")}
    assert isinstance(next_action(record, sts, ALLOW, MONDAY_1AM, 1.0), Wait)
    sts = {"n1": _status("n1", 1, 50.0)}
    assert next_action(record, sts, ALLOW, MONDAY_1AM, 1.0) == MarkApplied("n1", 50.0)


@pytest.mark.parametrize(
    ("now", "expected"),
    [
        # Sunday 23:59 +00:00: before Monday's window
        (datetime(2026, 1, 4, 23, 59, tzinfo=UTC), "pause:2026-01-05T02:00:00+00:00"),
        (datetime(2026, 1, 5, 2, 0, 59, tzinfo=UTC), "go"),  # inside
        (datetime(2026, 1, 5, 2, 1, tzinfo=UTC), "pause:2026-01-06T02:00:00+00:00"),  # closed
        (datetime(2026, 1, 6, 23, 0, tzinfo=UTC), "pause:2026-01-12T02:00:00+00:00"),  # Tue→Mon
        # the same instant seen from another offset changes nothing
        (datetime.fromisoformat("2026-01-05T04:00:30+02:00"), "go"),
    ],
)
def test_policy_is_checked_before_each_node_with_the_injected_clock(
    now: datetime, expected: str
) -> None:
    env = Env(policy=WINDOW, wall=datetime(2026, 1, 5, 2, 0, tzinfo=UTC))
    record = env.start()
    snap = env.rs.read_nodes()
    action = next_action(
        record, snap.statuses, parse_policy(env.config()), now, 0.0, snap.overrides
    )
    if expected == "go":
        assert isinstance(action, WriteOverride)
    else:
        assert isinstance(action, PauseForWindow)
        assert action.next_start.isoformat() == expected.split(":", 1)[1]
        paused = record_after(record, action, now)
        resumed = next_action(
            paused,
            snap.statuses,
            parse_policy(env.config()),
            action.next_start,
            0.0,
            snap.overrides,
        )
        assert resumed == Resume()


def test_record_round_trips_through_json() -> None:
    env = Env()
    record = env.start()
    record = record_after(
        record,
        WriteOverride("n1", record.target, 3),
        MONDAY_1AM,
        {"Backend": {"Type": "vxlan"}, "Generation": 2},
    )
    assert RolloutRecord.from_json(record.to_json()) == record
    doc = json.loads(record.to_json())
    assert doc["id"] == record.id and doc["state"] == "running"  # what agents read


# ---------------------------------------------------------------------------
# The driver over a FakeStore with simulated agents
# ---------------------------------------------------------------------------


def test_happy_path_over_five_nodes() -> None:
    env = Env()
    record = env.start()
    done = env.drive(record.id)
    assert done.state == "done" and done.reason is None and done.note is None
    assert [e.state for e in done.nodes] == ["done"] * 5
    switched = [line.split("] ")[1].split(":")[0] for line in env.lines if "switching" in line]
    assert switched == ["n1", "n2", "n3", "n4", "n5"]
    assert env.sim.lost == []  # every probe of every round answered, throughout
    assert env.config()["Backend"] == {"Type": "host-gw", "DirectRouting": False}
    sts = statuses(env)
    assert all(s.backend.type == "host-gw" and not s.vtep for s in sts.values())
    assert all(env.override(n) is None for n in sts)
    env.sim.tick()
    assert all(s.applied_generation is None for s in statuses(env).values())  # on the config
    for node in sts:  # one override write per node, generation 1, vouched by the rollout
        assert [(o.generation, o.rollout) for o in env.override_puts(node)] == [(1, record.id)]


def test_apply_timeout_rolls_the_node_back_and_fails() -> None:
    env = Env()
    env.sim.node("n3").ignore_type = "host-gw"
    record = env.start(timeout=20)
    failed = env.drive(record.id)
    assert failed.state == "failed"
    assert failed.reason is not None and failed.reason.startswith(
        "n3 did not apply generation 1 within 20 s (it reports no override generation, "
        "Ready, vxlan (MTU 1450))"
    )
    assert [e.state for e in failed.nodes] == ["done", "done", "rolled-back", "pending", "pending"]
    # n3 had no override: the rollback wrote the config's Backend, then removed it.
    assert [(o.backend, o.generation) for o in env.override_puts("n3")] == [
        (record.target, 1),
        ({"Type": "vxlan"}, 2),
    ]
    assert env.override("n3") is None
    assert statuses(env)["n3"].backend.type == "vxlan"
    assert env.override("n1") is not None and env.config()["Backend"] == VXLAN
    assert any("n3: FAILED: n3 did not apply generation 1" in line for line in env.lines)


def test_verify_failure_rolls_back_to_the_previous_override() -> None:
    env = Env()
    env.rs.write_override("n2", NodeOverride({"Type": "vxlan", "VNI": 1}, 7))
    env.sim.tick()
    env.sim.break_pairs("n2", ["n4"])
    record = env.start(timeout=15)
    failed = env.drive(record.id)
    assert failed.state == "failed"
    assert failed.reason == (
        "n2 failed verification after 15 s: n2 -> n4: unreachable; n4 -> n2: unreachable"
    )
    assert failed.entry("n2").state == "rolled-back"
    assert failed.entry("n2").previous == {"Backend": {"Type": "vxlan", "VNI": 1}, "Generation": 7}
    restored = env.override("n2")
    assert restored is not None and restored.backend == {"Type": "vxlan", "VNI": 1}
    assert restored.generation == 9 and restored.rollout == record.id
    assert statuses(env)["n2"].applied_generation == 9


def test_window_waits_before_proceeds_inside_pauses_between_nodes_and_resumes() -> None:
    # 1-minute windows on Monday and Tuesday at 02:00; each node takes ~20 s at a 10 s poll.
    env = Env(policy=WINDOW, wall=datetime(2026, 1, 5, 1, 59, tzinfo=UTC))
    record = env.start()
    paused = env.drive(record.id, poll=10.0)
    assert paused.state == "paused-window" and paused.next_window == "2026-01-05T02:00:00+00:00"
    assert all(e.state == "pending" for e in paused.nodes)
    env.clocks.sleep(30)  # still before the window: resume without waiting changes nothing
    prepare_resume(env.rs, env.clocks.wall, None)
    assert env.drive(record.id, poll=10.0).state == "paused-window"
    done = env.drive(record.id, poll=10.0, wait_for_window=True)
    assert done.state == "done"
    window = parse_policy(env.config()).window
    assert window is not None
    starts = [datetime.fromisoformat(e.started_at or "") for e in done.nodes]
    assert all(window_state(window, t).inside for t in starts)
    days = {t.date().isoformat() for t in starts}
    assert days == {"2026-01-05", "2026-01-06"}  # the window closed between nodes
    assert any(
        "paused: disruptive change (backend vxlan -> host-gw, MTU 1450 -> 1500) "
        "blocked by DisruptionPolicy AllowDuringMaintenanceWindow: outside the window; "
        "the next window starts 2026-01-06T02:00:00+00:00" in line
        for line in env.lines
    )
    assert any("the maintenance window is open" in line for line in env.lines)


def test_pause_then_resume() -> None:
    env = Env()
    record = env.start()

    def pause_on_n2(line: str) -> None:
        env.lines.append(line)
        if "n2: applied" in line:
            request_stop(env.rs, "pause", env.clocks.wall)

    paused = env.drive(record.id, display=pause_on_n2)
    assert paused.state == "paused" and paused.request is None
    assert [e.state for e in paused.nodes] == ["done", "done", "pending", "pending", "pending"]
    resumed = prepare_resume(env.rs, env.clocks.wall, None)
    assert resumed.state == "running"
    assert env.drive(record.id).state == "done"


def test_abort_stops_after_the_current_step_and_leaves_switched_nodes() -> None:
    env = Env()
    record = env.start()

    def abort_on_n3(line: str) -> None:
        if "n3: switching" in line:
            requested = request_stop(env.rs, "abort", env.clocks.wall)
            assert requested.request == "abort" and requested.state == "running"

    aborted = env.drive(record.id, display=abort_on_n3)
    assert aborted.state == "aborted"
    assert [e.state for e in aborted.nodes] == ["done", "done", "done", "pending", "pending"]
    assert [statuses(env)[n].backend.type for n in ("n1", "n3", "n4")] == [
        "host-gw",
        "host-gw",
        "vxlan",
    ]
    assert env.config()["Backend"] == VXLAN
    with pytest.raises(ConfigError, match="has ended"):
        prepare_resume(env.rs, env.clocks.wall, None)


def test_abort_while_paused_ends_at_once() -> None:
    env = Env(policy=WINDOW)
    record = env.start()
    assert env.drive(record.id).state == "paused-window"
    aborted = request_stop(env.rs, "abort", env.clocks.wall)
    assert aborted.state == "aborted" and aborted.request is None


def test_resume_after_a_driver_killed_mid_node() -> None:
    env = Env()
    record = env.start()

    class Killed(Exception):
        pass

    def die_on_n2(line: str) -> None:
        if "n2: switching" in line:
            raise Killed

    with pytest.raises(Killed):
        env.drive(record.id, display=die_on_n2, driver_id="first")
    left = _record(env)
    assert left.entry("n2").state == "applying" and left.driver == "first"
    prepare_resume(env.rs, env.clocks.wall, None)
    done = env.drive(record.id, driver_id="second")
    assert done.state == "done"
    assert [o.generation for o in env.override_puts("n2")] == [1]


def test_a_driver_stops_when_another_claims_the_record() -> None:
    env = Env()
    record = env.start()

    def take_over(line: str) -> None:
        env.lines.append(line)
        if "n2: switching" in line:
            _claim(env.rs, record.id, "other", env.clocks.wall)

    left = env.drive(record.id, display=take_over, driver_id="first")
    assert left.state == "running" and left.driver == "other"
    assert "another driver (other) took over" in env.lines[-1]


def test_start_refuses_while_another_rollout_is_unfinished() -> None:
    env = Env()
    first = env.start()
    with pytest.raises(ConfigError, match=f"rollout {first.id} is running; resume it"):
        env.start()
    env.drive(first.id)
    second = env.start("vxlan")  # the first one is done: a new one may start
    assert second.id != first.id


def test_force_skips_a_blocking_policy_and_leaves_records() -> None:
    from flannelpy.control.records import ForceRecord

    env = Env(policy={"Mode": "Block"})
    force = ForceRecord("incident 42", "ops@host", "2026-01-05T01:00:00+00:00")
    record = env.start(force=force, force_reason="incident 42")
    done = env.drive(record.id)
    assert done.state == "done" and done.force == force
    # Every override it wrote carries the record; each agent that applies one logs it
    # and writes the store event (a Kubernetes Event in Kubernetes mode) itself.
    assert all(o.force == force for n in ("n1", "n5") for o in env.override_puts(n))


def test_a_policy_that_turns_to_block_mid_rollout_pauses_it() -> None:
    env = Env()
    record = env.start()

    def block_after_n1(line: str) -> None:
        env.lines.append(line)
        if "n1: verified" in line:
            doc = env.config()
            doc["DisruptionPolicy"] = {"Mode": "Block"}
            env.store.put(config_key(PREFIX), json.dumps(doc).encode())

    paused = env.drive(record.id, display=block_after_n1)
    assert paused.state == "paused"
    assert paused.reason is not None and "blocked by DisruptionPolicy Block" in paused.reason
    assert [e.state for e in paused.nodes][:2] == ["done", "pending"]


@pytest.mark.parametrize("kube_mode", [True, False], ids=["kubernetes", "etcd"])
def test_a_rollback_applies_after_the_window_closed_mid_step_and_is_recorded(
    kube_mode: bool,
) -> None:
    """The window (02:00-02:01) is open when n1 switches and closed by the time its
    verification fails. In Kubernetes mode n1 checks the policy itself: before, it refused
    its own rollback and stayed on the backend that failed (the rollout failed with
    "rolling n1 back did not take effect")."""
    env = Env(policy=WINDOW, wall=datetime(2026, 1, 5, 2, 0, tzinfo=UTC), kube_mode=kube_mode)
    env.sim.break_pairs("n1", ["n4"])
    record = env.start(timeout=90)
    failed = env.drive(record.id, poll=10.0)
    assert not window_state(parse_policy(env.config()).window, env.clocks.wall).inside  # type: ignore[arg-type]
    assert failed.state == "failed"
    assert failed.reason is not None and failed.reason.startswith("n1 failed verification")
    assert [e.state for e in failed.nodes] == ["rolled-back", *["pending"] * 4]
    n1 = statuses(env)["n1"]
    assert n1.backend.type == "vxlan" and n1.blocked is None  # applied, not refused
    assert n1.applied_generation == failed.entry("n1").rollback_generation
    # Forced, so the node applied it whatever the policy said, and recorded it as it
    # records an operator's emergency override.
    rollback = env.override_puts("n1")[-1]
    assert rollback.backend == VXLAN and rollback.force is not None
    assert rollback.force.reason.startswith(f"rollback by rollout {record.id}: n1 failed")
    assert [(node, force) for node, _, force in env.sim.forced] == [("n1", rollback.force)]
    assert env.sim.forced[0][1].startswith("backend host-gw -> vxlan")


def test_host_gw_nodes_that_keep_a_vtep_only_leave_a_note() -> None:
    env = Env()
    record = env.start(timeout=10)
    env.sim.stuck_vteps.add("n4")
    done = env.drive(record.id)
    assert done.state == "done"
    assert done.note == (
        "n4 still report a VTEP 10 s after the last node switched; traffic is unaffected, "
        "check them with flannelpy doctor"
    )


def test_new_record_marks_nodes_on_the_target_as_skipped() -> None:
    env = Env()
    env.rs.write_override("n1", NodeOverride({"Type": "host-gw"}, 1))
    env.sim.tick()
    snap = env.rs.read_nodes()
    config = env.rs.read_config().config
    plan = plan_rollout(snap.statuses, config, {"Type": "host-gw"}, ALLOW, MONDAY_1AM)
    record = new_record(plan, "r1", VXLAN, MONDAY_1AM)
    assert record.entry("n1").skipped and record.entry("n1").state == "done"
    assert record.entry("n2").state == "pending"


def test_a_store_outage_mid_rollout_is_waited_out() -> None:
    env = Env()
    record = env.start()
    outage = {"sleeps": 0}
    sleep = env.clocks.sleep

    def flaky_sleep(seconds: float) -> None:
        if outage["sleeps"]:
            outage["sleeps"] -= 1
            env.clocks.mono += seconds
            env.store.set_available(outage["sleeps"] == 0)
            return
        sleep(seconds)

    def cut_on_n2(line: str) -> None:
        env.lines.append(line)
        if "n2: switching" in line:
            outage["sleeps"] = 5
            env.store.set_available(False)

    done = drive(
        env.rs,
        record.id,
        lambda: env.clocks.wall,
        flaky_sleep,
        cut_on_n2,
        monotonic=lambda: env.clocks.mono,
    )
    assert done.state == "done"
    assert sum("the store does not answer" in line for line in env.lines) == 1


def test_a_long_store_outage_ends_the_driver_with_the_record_intact() -> None:
    from flannelpy.errors import StoreUnavailable

    env = Env()
    record = env.start(timeout=10)

    def cut_on_n2(line: str) -> None:
        if "n2: switching" in line:
            env.store.set_available(False)

    with pytest.raises(StoreUnavailable):
        env.drive(record.id, display=cut_on_n2)
    env.store.set_available(True)
    assert _record(env).entry("n2").state == "applying"
    assert env.drive(record.id).state == "done"


@pytest.mark.parametrize(
    ("current", "target", "expected_mtu"),
    [
        ("vxlan", "wireguard", 1440),  # 1500 underlay: VXLAN costs 50, WireGuard over IPv4 60
        ("wireguard", "vxlan", 1450),
        ("host-gw", "wireguard", 1440),
        ("wireguard", "host-gw", 1500),
    ],
)
def test_expected_mtu_counts_each_backends_encapsulation(
    current: str, target: str, expected_mtu: int
) -> None:
    overlay = {"vxlan": 1450, "wireguard": 1440, "host-gw": 1500}[current]
    summary = BackendSummary(current, 1, 8472, False, overlay)
    config = parse_network_config(
        json.dumps({"Network": "10.244.0.0/16", "Backend": {"Type": target}})
    )
    assert expected_summary(summary, config.backend).mtu == expected_mtu
