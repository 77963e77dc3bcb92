"""The lab's multi-member etcd plan (``lab up --etcd-members 3``): member addresses and
namespaces, the static cluster's flags, what agents and flanneld are given, and the
status table; pure, no namespaces, no root."""

from __future__ import annotations

import argparse
import shutil
from ipaddress import IPv4Interface, IPv4Network
from pathlib import Path
from typing import Any

import pytest
from flannelpy_lab import agents, environ, etcd, flanneld, plan, status
from flannelpy_lab import cli as lab_cli
from flannelpy_lab import state as state_io
from flannelpy_lab.errors import LabError
from flannelpy_lab.state import LabState

from flannelpy.errors import ConfigError

SEGMENT = IPv4Network("100.64.9.0/24")


def make_state(tmp_path: Path, members: int, segments: int = 1) -> LabState:
    subnets = [SEGMENT, IPv4Network("100.64.10.0/24")][:segments]
    return plan.plan_lab(
        "unit",
        4,
        "vxlan",
        direct_routing=False,
        segments=segments,
        network="10.244.0.0/16",
        etcd_prefix="/coreos.com/network",
        subnets=subnets,
        overlay_bridge=False,
        lab_root=str(tmp_path),
        etcd_members=members,
    )


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_one_member_is_the_unchanged_default_on_the_host_address(tmp_path: Path) -> None:
    state = make_state(tmp_path, 1)
    assert state.etcd_members == []
    assert state.etcd_endpoint == "http://100.64.9.254:2379"
    assert state.etcd_endpoints == [state.etcd_endpoint]
    node = state.nodes[0]
    assert flag(agents.agent_argv(state, node), "--etcd-endpoints") == state.etcd_endpoint
    assert lab_cli.build_parser().parse_args(["up", "--name", "x"]).etcd_members == 1


def test_three_members_get_own_namespaces_and_addresses_on_segment_one(
    tmp_path: Path,
) -> None:
    state = make_state(tmp_path, 3, segments=2)
    members = state.etcd_members
    assert [m.namespace for m in members] == ["fpl-unit-e1", "fpl-unit-e2", "fpl-unit-e3"]
    assert [m.underlay_address for m in members] == [
        "100.64.9.241/24",
        "100.64.9.242/24",
        "100.64.9.243/24",
    ]
    assert state.etcd_endpoints == [
        "http://100.64.9.241:2379",
        "http://100.64.9.242:2379",
        "http://100.64.9.243:2379",
    ]
    assert state.etcd_endpoint == state.etcd_endpoints[0]
    # No member collides with a node, the router or the host attachment.
    taken = [IPv4Interface(n.underlay_address).ip for n in state.nodes]
    taken.append(IPv4Interface(state.host_address).ip)
    taken += [IPv4Interface(s.router_address).ip for s in state.segments if s.router_address]
    assert not {m.ip for m in members} & set(taken)
    assert len({m.data_dir for m in members}) == 3
    assert all(m.data_dir.startswith(state.lab_dir + "/") for m in members)
    assert all(plan.is_etcd_member_namespace("unit", m.namespace) for m in members)
    assert not plan.is_etcd_member_namespace("unit", state.nodes[0].namespace)
    assert not plan.is_etcd_member_namespace("unit", "fpl-unit-n1-p1")


def test_recreated_nodes_never_take_a_member_address() -> None:
    assert plan.next_free_host(range(plan.RECREATE_FIRST_HOST, 240)) == 240
    with pytest.raises(ConfigError, match="no free underlay address"):
        plan.next_free_host(range(plan.RECREATE_FIRST_HOST, plan.ETCD_MEMBER_FIRST_HOST))


@pytest.mark.parametrize("count", [0, 2, 4, 7])
def test_member_count_must_be_odd_and_known(tmp_path: Path, count: int) -> None:
    with pytest.raises(ConfigError, match=f"--etcd-members {count} is invalid"):
        make_state(tmp_path, count)


@pytest.mark.skipif(shutil.which("etcd") is None, reason="etcd is not installed")
def test_member_runs_in_its_namespace_as_a_static_cluster(tmp_path: Path) -> None:
    state = make_state(tmp_path, 3)
    member = state.etcd_members[1]
    argv = etcd.member_argv(state, member)
    assert argv[:4] == ["ip", "netns", "exec", "fpl-unit-e2"]
    assert flag(argv, "--name") == "fpl-unit-e2"
    assert flag(argv, "--listen-client-urls") == "http://100.64.9.242:2379"
    assert flag(argv, "--listen-peer-urls") == "http://100.64.9.242:2380"
    assert flag(argv, "--data-dir") == member.data_dir
    assert flag(argv, "--initial-cluster") == (
        "fpl-unit-e1=http://100.64.9.241:2380,fpl-unit-e2=http://100.64.9.242:2380,"
        "fpl-unit-e3=http://100.64.9.243:2380"
    )
    assert flag(argv, "--initial-cluster-token") == "fpl-unit"
    assert flag(argv, "--initial-cluster-state") == "new"
    assert "--pre-vote" in argv  # a healed member rejoins without forcing an election


def test_every_agent_and_flanneld_gets_all_client_urls(tmp_path: Path) -> None:
    state = make_state(tmp_path, 3)
    urls = ",".join(state.etcd_endpoints)
    state.extra["flanneld_binary"] = "/bin/true"
    for node in state.nodes:
        assert flag(agents.agent_argv(state, node), "--etcd-endpoints") == urls
        assert flag(flanneld.argv(state, node), "--etcd-endpoints") == urls
    assert environ.store_environ(state)["FLANNELD_ETCD_ENDPOINTS"] == urls
    assert environ.node_environ(state, state.nodes[0])["FLANNELD_ETCD_ENDPOINTS"] == urls


def test_members_survive_the_state_file(tmp_path: Path) -> None:
    state = make_state(tmp_path, 3)
    state.etcd_members[0].pid = 4242
    state_io.save(state)
    loaded = state_io.load(state.lab_dir)
    assert loaded is not None
    assert loaded.etcd_members == state.etcd_members
    assert loaded.etcd_member("e1").pid == 4242
    with pytest.raises(LabError, match="has no etcd member 'e9'"):
        loaded.etcd_member("e9")


def _member(
    name: str,
    running: bool,
    ident: str | None,
    leader_id: str | None,
    leader: bool,
    error: str | None = None,
) -> dict[str, Any]:
    return {
        "name": name,
        "client_url": f"http://{name}:2379",
        "pid": 7 if running else None,
        "running": running,
        "id": ident,
        "leader_id": leader_id,
        "raft_term": 3,
        "error": error,
        "leader": leader,
    }


def test_the_leader_is_the_one_a_majority_names() -> None:
    partitioned = etcd.mark_leader(
        [
            _member("e1", True, "a1", "a1", False),  # cut off, still thinks it leads
            _member("e2", True, "b2", "c3", False),
            _member("e3", True, "c3", "c3", False),
        ]
    )
    assert [d["leader"] for d in partitioned] == [False, False, True]
    lone = etcd.mark_leader(
        [
            _member("e1", True, "a1", "0", False),
            _member("e2", False, None, None, False),
            _member("e3", True, "c3", "c3", False),
        ]
    )
    assert not any(d["leader"] for d in lone)  # one vote of three is no majority


def test_status_table_marks_the_leader_and_down_or_cut_off_members() -> None:
    lines = status.render_members(
        [
            _member("e1", True, "a1", "b2", False),
            _member("e2", True, "b2", "b2", True),
            _member("e3", False, None, None, False),
        ]
    )
    text = "\n".join(lines)
    assert "etcd members: 3, leader elected" in text
    row = {line.split()[0]: line for line in lines if line.startswith("e")}
    assert "follower" in row["e1"] and "leader" in row["e2"].split()
    assert row["e3"].split()[-1] == "down"
    cut = status.render_members([_member("e1", True, None, None, False, error="timed out")])
    assert "no leader" in cut[1] and "unreachable (timed out)" in cut[-1]
    assert status.render_members([]) == []


def test_cli_takes_the_member_count() -> None:
    args = lab_cli.build_parser().parse_args(["up", "--name", "x", "--etcd-members", "3"])
    assert isinstance(args, argparse.Namespace) and args.etcd_members == 3
    with pytest.raises(SystemExit):
        lab_cli.build_parser().parse_args(["up", "--name", "x", "--etcd-members", "2"])
