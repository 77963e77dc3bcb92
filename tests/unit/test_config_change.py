"""What a running node does with a new network config or override (pure)."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import pytest

from flannelpy.control.change import ChangeDecision, decide_change, wanted_config
from flannelpy.control.node_control import rollout_vouches
from flannelpy.control.records import (
    BackendSummary,
    BlockedChange,
    ForceRecord,
    NodeOverride,
    NodeStatus,
    PeerProbe,
    ProbeSummary,
)
from flannelpy.errors import ConfigError
from flannelpy.subnet.keys import node_of_key, override_key, status_key

# A Wednesday, 12:00 UTC.
NOON_WED = datetime(2026, 12, 2, 12, 0, tzinfo=UTC)


def conf(backend: dict[str, Any], policy: dict[str, Any] | None = None, **extra: Any) -> bytes:
    doc: dict[str, Any] = {"Network": "10.244.0.0/16", "Backend": backend, **extra}
    if policy is not None:
        doc["DisruptionPolicy"] = policy
    return json.dumps(doc).encode()


VXLAN = {"Type": "vxlan"}
HOSTGW = {"Type": "host-gw"}
BLOCK = {"Mode": "Block"}
WINDOW_SAT = {
    "Mode": "AllowDuringMaintenanceWindow",
    "Window": {"Days": ["Sat"], "Start": "02:00", "Duration": "4h", "UTCOffset": "+00:00"},
}


def decide(
    running: bytes,
    wanted: bytes,
    override: NodeOverride | None = None,
    rollout: Any = None,
    now: datetime = NOON_WED,
    mtus: tuple[int, int] = (1450, 1500),
) -> ChangeDecision:
    return decide_change(
        wanted_config(running, None),
        mtus[0],
        wanted_config(wanted, override),
        mtus[1],
        override,
        rollout,
        now,
    )


def test_same_config_is_nothing_to_do() -> None:
    assert decide(conf(VXLAN), conf(VXLAN), mtus=(1450, 1450)).action == "none"


def test_direct_routing_alone_applies_at_once_even_under_block() -> None:
    wanted = conf({"Type": "vxlan", "DirectRouting": True}, BLOCK)
    decision = decide(conf(VXLAN, BLOCK), wanted, mtus=(1450, 1450))
    assert decision.action == "apply" and decision.changes == ()


def test_policy_change_alone_is_applied_not_blocked() -> None:
    assert decide(conf(VXLAN), conf(VXLAN, BLOCK), mtus=(1450, 1450)).action == "apply"


def test_backend_switch_under_block_is_blocked_with_the_policy_sentence() -> None:
    decision = decide(conf(VXLAN, BLOCK), conf(HOSTGW, BLOCK))
    assert decision.action == "block"
    assert "vxlan -> host-gw" in " ".join(decision.changes)
    assert decision.sentence is not None and "Block" in decision.sentence
    assert "--force" in decision.sentence


def test_no_policy_means_allow() -> None:
    decision = decide(conf(VXLAN), conf(HOSTGW))
    assert decision.action == "apply" and decision.changes


def test_window_blocks_outside_and_names_the_next_start() -> None:
    decision = decide(conf(VXLAN, WINDOW_SAT), conf(HOSTGW, WINDOW_SAT))
    assert decision.action == "block"
    assert decision.sentence is not None and "2026-12-05T02:00" in decision.sentence
    inside = datetime(2026, 12, 5, 3, 0, tzinfo=UTC)
    assert decide(conf(VXLAN, WINDOW_SAT), conf(HOSTGW, WINDOW_SAT), now=inside).action == "apply"


def test_vni_and_port_and_mtu_are_disruptive() -> None:
    for backend in (
        {"Type": "vxlan", "VNI": 2},
        {"Type": "vxlan", "Port": 4789},
        {"Type": "vxlan", "MTU": 1400},
    ):
        decision = decide(conf(VXLAN, BLOCK), conf(backend, BLOCK), mtus=(1450, 1350))
        assert decision.action == "block", backend


def test_force_overrides_block_and_carries_the_record() -> None:
    force = ForceRecord("incident 42", "ops@host", "2026-12-02T12:00:00Z")
    override = NodeOverride(HOSTGW, generation=3, force=force)
    decision = decide(conf(VXLAN, BLOCK), conf(VXLAN, BLOCK), override=override)
    assert decision.action == "apply" and decision.forced == force


def test_active_rollout_vouches_for_its_override_only() -> None:
    override = NodeOverride(HOSTGW, generation=1, rollout="r1")
    running = {"id": "r1", "state": "running"}
    assert decide(conf(VXLAN, BLOCK), conf(VXLAN, BLOCK), override, running).vouched
    for rollout in (
        None,
        {"id": "r2", "state": "running"},
        {"id": "r1", "state": "paused"},
        {"id": "r1", "state": "aborted"},
    ):
        decision = decide(conf(VXLAN, BLOCK), conf(VXLAN, BLOCK), override, rollout)
        assert decision.action == "block", rollout
    assert not rollout_vouches({"id": "r1", "state": "running"}, None)


def test_network_change_needs_a_restart_and_is_not_applied() -> None:
    decision = decide(
        conf(VXLAN),
        json.dumps({"Network": "10.250.0.0/16", "Backend": VXLAN}).encode(),
        mtus=(1450, 1450),
    )
    assert decision.action == "restart-needed" and "restart" in (decision.sentence or "")


def test_override_replaces_backend_case_insensitively() -> None:
    raw = json.dumps({"network": "10.244.0.0/16", "backend": {"type": "vxlan"}}).encode()
    config = wanted_config(raw, NodeOverride({"Type": "host-gw"}, 1))
    assert config.backend.type == "host-gw"


def test_bad_override_backend_names_the_override() -> None:
    with pytest.raises(ConfigError, match="override"):
        wanted_config(conf(VXLAN), NodeOverride({"Type": "udp-magic"}, 1))


def test_override_json_round_trip_and_refusals() -> None:
    force = ForceRecord("r", "me", "t")
    override = NodeOverride({"Type": "host-gw"}, 7, rollout="abc", force=force)
    assert NodeOverride.from_json(override.to_json()) == override
    for bad in ("[]", '{"Backend": 1}', '{"Backend": {}, "Generation": -1}', "nope"):
        with pytest.raises(ValueError):
            NodeOverride.from_json(bad)


def test_status_json_round_trip() -> None:
    status = NodeStatus(
        node="n1",
        at=12.5,
        ready=True,
        public_ip="100.64.0.2",
        underlay_networks=("100.64.0.0/24",),
        backend=BackendSummary("vxlan", 1, 8472, True, 1450),
        vtep=True,
        applied_generation=4,
        applied_at=10.0,
        blocked=BlockedChange(5, "backend vxlan -> host-gw", "blocked by Block", 11.0),
        subnets=("10.244.1.0/24",),
        probes=ProbeSummary.of({"10.244.2.0/24": PeerProbe(True, True, True, 3, 12.0)}),
    )
    assert NodeStatus.from_json(status.to_json()) == status
    with pytest.raises(ValueError):
        NodeStatus.from_json('{"Node": "n1"}')


def test_record_keys() -> None:
    prefix = "/coreos.com/network"
    assert node_of_key(prefix, override_key(prefix, "n1")) == ("n1", "override")
    assert node_of_key(prefix, status_key(prefix + "/", "n2")) == ("n2", "status")
    assert node_of_key(prefix, prefix + "/flannelpy/nodes/n1/other") is None
    assert node_of_key(prefix, prefix + "/subnets/10.244.1.0-24") is None


def test_switching_the_firewall_mode_needs_a_restart() -> None:
    decision = decide(conf(VXLAN), conf(VXLAN, EnableNFTables=True), mtus=(1450, 1450))
    assert decision.action == "restart-needed" and "EnableNFTables" in (decision.sentence or "")
