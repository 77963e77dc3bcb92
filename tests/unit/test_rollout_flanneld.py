"""Rollout plans in a cluster with flanneld nodes: refused when the target cuts them off.

flanneld reads no override and ignores every lease of another BackendType, so a target
it cannot follow must be refused before any node switches; a target it keeps speaking
(the same type, VNI and port) is planned around.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from ipaddress import IPv4Address, IPv4Network

import pytest

from flannelpy.commands.rollout import _command
from flannelpy.config.netconf import BackendConfig
from flannelpy.control.records import NodeOverride
from flannelpy.errors import ConfigError
from flannelpy.rollout.driver import make_plan, prepare_resume, start
from flannelpy.rollout.flanneld import FlanneldNode, flanneld_nodes, flanneld_problems
from flannelpy.rollout.show import NodeRow, status_rows
from flannelpy.subnet.keys import lease_key
from flannelpy.subnet.lease import Lease, LeaseAttrs
from tests.unit.test_rollout import MONDAY_1AM, PREFIX, Env, statuses


def flanneld_value(ip: str, backend_type: str = "vxlan", vni: int = 1) -> bytes:
    """A lease value as flanneld v0.28 writes it: no Flannelpy extension."""
    doc: dict[str, object] = {"PublicIP": ip, "PublicIPv6": None, "BackendType": backend_type}
    if backend_type == "vxlan":
        doc["BackendData"] = {"VNI": vni, "VtepMAC": "0a:58:0a:f4:09:00"}
    return json.dumps(doc).encode()


def ours(subnet: str, ip: str) -> Lease:
    attrs = LeaseAttrs(
        IPv4Address(ip),
        "vxlan",
        {"VNI": 1, "VtepMAC": "aa:bb:cc:00:00:01"},
        node_name="n1",
        mtu=1450,
    )
    return Lease(IPv4Network(subnet), attrs)


def with_flanneld(env: Env, *nodes: tuple[str, str, str]) -> None:
    for subnet, ip, backend_type in nodes:
        env.store.put(lease_key(PREFIX, IPv4Network(subnet)), flanneld_value(ip, backend_type))


def test_leases_without_our_extension_are_flanneld_nodes_unless_a_status_claims_them() -> None:
    env = Env()
    with_flanneld(
        env, ("10.244.9.0/24", "100.64.0.10", "vxlan"), ("10.244.1.0/24", "100.64.0.2", "vxlan")
    )
    env.store.put(
        lease_key(PREFIX, IPv4Network("10.244.2.0/24")),
        ours("10.244.2.0/24", "100.64.0.3").attrs.to_json().encode(),
    )
    statuses = env.rs.read_nodes().statuses
    found = flanneld_nodes(env.rs.read_leases(), statuses)
    # 10.244.1.0/24 has no extension but n1's status lists it: an older agent of ours.
    assert found == [
        FlanneldNode(IPv4Network("10.244.9.0/24"), IPv4Address("100.64.0.10"), "vxlan", 1)
    ]


def test_host_gw_target_is_refused_naming_every_flanneld_node() -> None:
    env = Env()
    with_flanneld(
        env, ("10.244.9.0/24", "100.64.0.10", "vxlan"), ("10.244.8.0/24", "100.64.0.11", "vxlan")
    )
    plan = make_plan(env.rs, "host-gw", MONDAY_1AM)
    flanneld = [p for p in plan.problems if p.startswith("flanneld node")]
    assert flanneld == [
        "flanneld node(s) 10.244.8.0/24 (100.64.0.11), which runs vxlan, 10.244.9.0/24 "
        "(100.64.0.10), which runs vxlan cannot follow a rollout to host-gw (flanneld reads "
        "no override, ignores leases of another backend and reads its Backend from "
        "net-conf.json only when it starts): migrate them to flannelpy first, or change the "
        "Backend in net-conf.json for every node at once and restart the flanneld nodes"
    ]
    with pytest.raises(ConfigError, match=r"10\.244\.8\.0/24"):
        start(env.rs, plan, MONDAY_1AM)
    assert env.rs.read_record() == (None, 0)


def test_nodes_of_ours_brought_back_to_the_configs_backend_are_planned_around_flanneld() -> None:
    env = Env()
    with_flanneld(env, ("10.244.9.0/24", "100.64.0.10", "vxlan"))
    env.rs.write_override("n2", NodeOverride({"Type": "host-gw"}, 4))
    env.sim.tick()
    plan = make_plan(env.rs, "vxlan", MONDAY_1AM)
    assert plan.problems == ()
    assert [s.node for s in plan.to_switch] == ["n2"]
    assert (
        "flanneld nodes (not switched; they keep the network config's Backend): "
        "10.244.9.0/24 (100.64.0.10)"
    ) in plan.lines()


def test_direct_routing_is_refused_while_flanneld_nodes_take_it_from_the_config() -> None:
    env = Env()
    with_flanneld(env, ("10.244.9.0/24", "100.64.0.10", "vxlan"))
    (problem,) = make_plan(env.rs, "vxlan", MONDAY_1AM, direct_routing=True).problems
    assert problem.startswith(
        "flanneld node(s) 10.244.9.0/24 (100.64.0.10), which runs DirectRouting off until it "
        "restarts cannot follow a rollout to vxlan (VNI 1, port 8472, DirectRouting on)"
    )


def test_vxlan_with_another_vni_or_port_cuts_flanneld_off() -> None:
    node = FlanneldNode(IPv4Network("10.244.9.0/24"), IPv4Address("100.64.0.10"), "vxlan", 1)
    current = BackendConfig()
    assert flanneld_problems([node], current, BackendConfig(mtu=1400)) == []
    (vni,) = flanneld_problems([node], current, BackendConfig(vni=2))
    assert "which has VNI 1 cannot follow a rollout to vxlan (VNI 2, port 8472," in vni
    (port,) = flanneld_problems([node], current, BackendConfig(port=4789))
    assert "which listens on UDP port 8472" in port
    # A flanneld node on host-gw is cut off by a vxlan target, and left alone by host-gw.
    hostgw = FlanneldNode(node.subnet, node.public_ip, "host-gw", None)
    assert flanneld_problems([hostgw], BackendConfig("host-gw"), BackendConfig("host-gw")) == []
    assert "runs host-gw" in flanneld_problems([hostgw], BackendConfig("host-gw"), current)[0]


def test_without_flanneld_nodes_nothing_changes() -> None:
    env = Env()
    plan = make_plan(env.rs, "host-gw", MONDAY_1AM)
    assert plan.problems == () and plan.flanneld == ()
    assert not any(line.startswith("flanneld") for line in plan.lines())


def test_a_flanneld_node_joining_mid_rollout_pauses_it_before_the_next_node() -> None:
    """Before: the plan's check ran once, so the driver went on switching nodes to
    host-gw that a flanneld node joined after the start could not reach."""
    env = Env()
    record = env.start()

    def flanneld_joins_after_n1(line: str) -> None:
        env.lines.append(line)
        if "n1: verified" in line:
            with_flanneld(env, ("10.244.9.0/24", "100.64.0.10", "vxlan"))

    paused = env.drive(record.id, display=flanneld_joins_after_n1)
    assert paused.state == "paused"
    assert [e.state for e in paused.nodes] == ["done", "pending", "pending", "pending", "pending"]
    assert paused.reason is not None and paused.reason.startswith(
        "flanneld node(s) 10.244.9.0/24 (100.64.0.10), which runs vxlan cannot follow"
    )
    assert paused.reason.endswith("; then run flannelpy rollout resume")
    assert env.override("n2") is None
    # resume refuses while the flanneld node is there, and goes on once it has left.
    with pytest.raises(ConfigError, match=r"flanneld node\(s\) 10\.244\.9\.0/24"):
        prepare_resume(env.rs, env.clocks.wall, None)
    assert env.rs.read_record()[0] == paused
    key = lease_key(PREFIX, IPv4Network("10.244.9.0/24"))
    kv = env.store.get(key)
    assert kv is not None and env.store.delete_if_mod_revision(key, kv.mod_revision)
    assert prepare_resume(env.rs, env.clocks.wall, None).state == "running"
    assert env.drive(record.id).state == "done"


def test_a_flanneld_node_joining_before_the_config_is_written_stops_the_last_step() -> None:
    env = Env()
    record = env.start()

    def flanneld_joins_after_n5(line: str) -> None:
        env.lines.append(line)
        if "n5: verified" in line:
            with_flanneld(env, ("10.244.9.0/24", "100.64.0.10", "vxlan"))

    paused = env.drive(record.id, display=flanneld_joins_after_n5)
    assert paused.state == "paused" and not paused.config_written
    assert env.config()["Backend"] == {"Type": "vxlan"}


def test_status_shows_flanneld_nodes_and_which_the_target_cuts_off() -> None:
    env = Env()
    with_flanneld(env, ("10.244.9.0/24", "100.64.0.10", "vxlan"))
    record = env.start("vxlan", direct_routing=False)  # planned around: nothing to switch
    config = env.rs.read_config().config.backend
    flanneld = flanneld_nodes(env.rs.read_leases(), statuses(env))
    rows = status_rows(record, statuses(env), flanneld, config)
    assert rows[-1] == NodeRow(
        "10.244.9.0/24 (100.64.0.10)", "flanneld (not switched)", "vxlan (VNI 1)", None, None, None
    )
    assert [r.node for r in rows[:-1]] == ["n1", "n2", "n3", "n4", "n5"]
    hostgw = replace(record, target={"Type": "host-gw"}, state="paused")
    row = status_rows(hostgw, {}, flanneld, config)[-1]
    assert row.blocked == "the target cuts it off: it runs vxlan"
    assert status_rows(replace(hostgw, state="done"), {}, flanneld, config)[-1].blocked is None


def test_rollout_status_command_lists_flanneld_nodes(
    capsys: pytest.CaptureFixture[str],
) -> None:
    env = Env()
    with_flanneld(env, ("10.244.9.0/24", "100.64.0.10", "vxlan"))
    args = argparse.Namespace(rollout_command="status", json=False, clock_start=None)
    assert _command(args, env.rs) == 0
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if ln.startswith("10.244.9.0/24"))
    assert line.split() == [
        "10.244.9.0/24",
        "(100.64.0.10)",
        "flanneld",
        "(not",
        "switched)",
        "vxlan",
        "(VNI",
        "1)",
        "-",
        "-",
        "-",
    ]
