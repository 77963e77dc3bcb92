"""The netns lab without agents: underlay, host attachment, etcd, teardown, coexistence.

The agent lifecycle (start, readiness, overlay address) is driven here with a
stand-in process (``sleep``) and a subnet.env the test writes itself, as the
agent would; the real agent is exercised by the other end-to-end tests.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from concurrent.futures import ThreadPoolExecutor
from ipaddress import IPv4Interface, IPv4Network

import pytest
from flannelpy_lab import Lab, LabError, agents, cli, etcd, plan, procs, status, topology
from flannelpy_lab.state import NodeInfo

from flannelpy.errors import ConfigError
from tests.support.lab_util import host_snapshot, lab_residue, running_lab, unique_lab_name

# -- pure planning ---------------------------------------------------------


@pytest.mark.parametrize("name", ["a", "lab1", "z9z9z9"])
def test_valid_lab_names(name: str) -> None:
    assert plan.validate_name(name) == name


@pytest.mark.parametrize("name", ["", "toolong7", "Lab", "a-b", "a_b", "a b"])
def test_invalid_lab_names_are_refused(name: str) -> None:
    with pytest.raises(ConfigError, match="lab name"):
        plan.validate_name(name)


def test_subnets_skip_host_routes_and_other_labs() -> None:
    used = [
        IPv4Network("0.0.0.0/0"),  # a default route overlaps everything and must not count
        IPv4Network("100.64.0.0/23"),
        IPv4Network("100.64.2.7/32"),
    ]
    assert plan.choose_subnets(used, 2) == [
        IPv4Network("100.64.3.0/24"),
        IPv4Network("100.64.4.0/24"),
    ]


def test_no_free_subnet_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match="no free /24"):
        plan.choose_subnets([IPv4Network("100.64.0.0/10")], 1)


@pytest.mark.parametrize(
    ("nodes", "on_first"), [(2, ["n1"]), (3, ["n1", "n2"]), (5, ["n1", "n2", "n3"])]
)
def test_first_half_rounded_up_goes_to_segment_one(nodes: int, on_first: list[str]) -> None:
    state = _plan(nodes=nodes, segments=2)
    assert [n.name for n in state.nodes if n.segment == 1] == on_first
    assert all(n.segment == 2 for n in state.nodes if n.name not in on_first)


def test_plan_addresses_names_and_host_route() -> None:
    state = _plan(nodes=4, segments=2)
    assert [n.underlay_address for n in state.nodes] == [
        "100.64.8.1/24",
        "100.64.8.2/24",
        "100.64.9.3/24",
        "100.64.9.4/24",
    ]
    assert state.host_address == "100.64.8.254/24"
    assert state.etcd_endpoint == "http://100.64.8.254:2379"
    assert state.host_routes == [{"dst": "100.64.9.0/24", "via": "100.64.8.253"}]
    assert [s.router_address for s in state.segments] == ["100.64.8.253/24", "100.64.9.253/24"]
    assert plan.other_segment_route(state, state.nodes[0]) == ("100.64.9.0/24", "100.64.8.253")
    assert plan.other_segment_route(state, state.nodes[3]) == ("100.64.8.0/24", "100.64.9.253")
    names = [state.host_link, *(n.switch_port for n in state.nodes)]
    assert all(len(n.encode()) <= plan.IFNAMSIZ for n in names)
    assert state.nodes[2].namespace == "fpl-abcdef-n3"
    assert state.nodes[2].subnet_env.endswith("/abcdef/nodes/n3/run/flannel/subnet.env")


def test_one_segment_plan_has_no_router() -> None:
    state = _plan(nodes=3, segments=1)
    assert state.router_namespace is None and state.host_routes == []
    assert plan.other_segment_route(state, state.nodes[0]) is None


def test_bridge_macs_are_pinned_unicast_and_local() -> None:
    mac = plan.pinned_mac("abc", "sw1")
    first = int(mac.split(":")[0], 16)
    assert first & 0x01 == 0 and first & 0x02 == 0x02
    assert mac == plan.pinned_mac("abc", "sw1") != plan.pinned_mac("abc", "sw2")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"backend": "udp"}, "--backend"),
        ({"backend": "host-gw", "direct_routing": True}, "--direct-routing needs"),
        ({"nodes": 0}, "--nodes"),
        ({"segments": 3}, "--segments"),
        ({"nodes": 1, "segments": 2}, "at least 2 nodes"),
        ({"network": "10.244.0.0/33"}, "--network"),
        ({"network": "100.64.0.0/16"}, "overlaps the lab underlay"),
    ],
)
def test_bad_requests_are_refused_before_touching_the_host(kwargs: dict, message: str) -> None:
    args = {
        "nodes": 3,
        "backend": "vxlan",
        "direct_routing": False,
        "segments": 1,
        "network": "10.244.0.0/16",
    } | kwargs
    with pytest.raises(ConfigError, match=message):
        plan.validate_request("ok", **args)


def test_net_conf_matches_flannel() -> None:
    assert json.loads(plan.net_conf_json("10.244.0.0/16", "vxlan", True)) == {
        "Network": "10.244.0.0/16",
        "Backend": {"Type": "vxlan", "DirectRouting": True},
    }
    assert plan.net_conf("10.1.0.0/16", "host-gw", False)["Backend"] == {"Type": "host-gw"}


def test_subnet_env_parsing() -> None:
    env = agents.parse_subnet_env(
        "FLANNEL_NETWORK=10.244.0.0/16\nFLANNEL_SUBNET=10.244.3.1/24\n"
        "FLANNEL_MTU=1450\nFLANNEL_IPMASQ=true\n"
    )
    assert env == agents.SubnetEnv("10.244.0.0/16", "10.244.3.1/24", 1450, True)
    with pytest.raises(ValueError, match="FLANNEL_SUBNET, FLANNEL_MTU"):
        agents.parse_subnet_env("FLANNEL_NETWORK=10.244.0.0/16\n")


def test_status_text_has_matrix_and_verdict() -> None:
    doc = {
        "name": "x",
        "backend": "vxlan",
        "nodes": [],
        "leases": [],
        "matrix": {"n1": {"n2": True}, "n2": {"n1": False}},
    }
    text = status.render_text(doc)
    assert "n1  .   ok" in text and "n2  --  ." in text
    assert "1 of 2 node pairs do not reach" in text


def _plan(nodes: int, segments: int) -> plan.LabState:
    subnets = [IPv4Network(f"100.64.{8 + i}.0/24") for i in range(segments)]
    return plan.plan_lab(
        "abcdef",
        nodes,
        "vxlan",
        direct_routing=False,
        segments=segments,
        network="10.244.0.0/16",
        etcd_prefix="/coreos.com/network",
        subnets=subnets,
        overlay_bridge=True,
        lab_root="/run/flannelpy-lab",
    )


# -- real namespaces -------------------------------------------------------


def _underlay_matrix(lab: Lab) -> dict[tuple[str, str], bool]:
    pairs = [(a.name, b.name) for a in lab.nodes for b in lab.nodes if a.name != b.name]
    with ThreadPoolExecutor(max_workers=len(pairs)) as pool:
        results = pool.map(lambda p: lab.ping_underlay(*p), pairs)
    return dict(zip(pairs, results, strict=True))


def _route_dev(address: str) -> str:
    out = topology.ip("-j", "route", "get", address).stdout
    return str(json.loads(out)[0]["dev"])


@pytest.mark.netns
@pytest.mark.lab
def test_two_segment_lab_comes_up_and_goes_away_completely() -> None:
    before = host_snapshot()
    name = unique_lab_name()
    lab = Lab.up(name, nodes=4, backend="vxlan", segments=2, start_agents=False)
    try:
        state = lab.state
        assert set(topology.lab_namespaces(name)) == {
            f"fpl-{name}-{r}" for r in ("sw1", "sw2", "rtr", "n1", "n2", "n3", "n4")
        }
        # Every node reaches every other, on its segment and across the router.
        matrix = _underlay_matrix(lab)
        assert all(matrix.values()), [p for p, ok in matrix.items() if not ok]
        # The switch bridges keep the MAC the lab pinned (design.md trap 1).
        for seg in state.segments:
            link = json.loads(
                topology.ip("-j", "link", "show", "br0", ns=seg.switch_namespace).stdout
            )
            assert link[0]["address"] == seg.bridge_mac
        # Lab addresses are on-link from the host: none would take the default route.
        assert _route_dev(str(state.nodes[0].ip)) == state.host_link
        assert _route_dev(str(state.nodes[3].ip)) == state.host_link
        assert _route_dev(str(IPv4Interface(state.host_address).ip)) == "lo"
        for node in lab.nodes:
            assert lab.exec(node.name, ["cat", "/proc/sys/net/ipv4/ip_forward"]).stdout == "1\n"
        # etcd answers the host through the lab address, with the lab's network config.
        with etcd.client(lab.etcd_endpoint) as c:
            value, _ = c.get(f"{state.etcd_prefix}/config")
        assert json.loads(value) == {"Network": "10.244.0.0/16", "Backend": {"Type": "vxlan"}}
        # Another process sees the same lab.
        assert Lab.load(name).state == state
        etcd_pid = state.etcd_pid
        assert etcd_pid is not None and procs.alive(procs.ref_of(etcd_pid, state.etcd_start_ticks))
    finally:
        lab.down()
    assert lab_residue(before, host_snapshot(), name) == []
    assert not os.path.exists(state.lab_dir)
    assert not procs.alive(procs.ref_of(etcd_pid, state.etcd_start_ticks))
    lab.down()  # a second down is a no-op
    with pytest.raises(LabError, match="no lab"):
        Lab.load(name)


@pytest.mark.netns
@pytest.mark.lab
def test_two_labs_coexist_with_distinct_addresses() -> None:
    before = host_snapshot()
    with (
        running_lab(nodes=2, start_agents=False) as a,
        running_lab(nodes=2, backend="host-gw", network="10.50.0.0/16", start_agents=False) as b,
    ):
        a_net = IPv4Network(a.state.segments[0].subnet)
        b_net = IPv4Network(b.state.segments[0].subnet)
        assert not a_net.overlaps(b_net)
        assert a.etcd_endpoint != b.etcd_endpoint
        for lab, network in ((a, "10.244.0.0/16"), (b, "10.50.0.0/16")):
            with etcd.client(lab.etcd_endpoint) as c:
                value, _ = c.get(f"{lab.state.etcd_prefix}/config")
            assert json.loads(value)["Network"] == network
            assert lab.ping_underlay("n1", "n2") and lab.ping_underlay("n2", "n1")
        names = (a.name, b.name)
    for name in names:
        assert lab_residue(before, host_snapshot(), name) == []


@pytest.mark.netns
@pytest.mark.lab
def test_recreated_node_gets_a_new_address_on_its_segment() -> None:
    with running_lab(nodes=2, start_agents=False) as lab:
        old = lab.node("n2").underlay_address
        marker = os.path.join(lab.node("n2").node_dir, "kept")
        os.makedirs(lab.node("n2").node_dir, exist_ok=True)
        open(marker, "w").close()
        info = lab.recreate_node("n2")
        assert info.underlay_address != old
        assert IPv4Interface(info.underlay_address).network == IPv4Interface(old).network
        assert Lab.load(lab.name).node("n2").underlay_address == info.underlay_address
        assert os.path.exists(marker)
        assert lab.ping_underlay("n1", "n2")
        proc = lab.exec(
            "n1", ["ping", "-c", "1", "-W", "1", str(IPv4Interface(old).ip)], check=False
        )
        assert proc.returncode != 0
        with pytest.raises(ConfigError, match="not a free host address"):
            lab.recreate_node("n2", new_address=lab.node("n1").underlay_address)
        with pytest.raises(LabError, match="exited with"):
            lab.exec("n1", ["false"])


def _write_subnet_env(node: NodeInfo, subnet: str) -> None:
    os.makedirs(os.path.dirname(node.subnet_env), exist_ok=True)
    tmp = node.subnet_env + ".tmp"
    with open(tmp, "w") as f:
        f.write(
            f"FLANNEL_NETWORK=10.244.0.0/16\nFLANNEL_SUBNET={subnet}\n"
            "FLANNEL_MTU=1400\nFLANNEL_IPMASQ=true\n"
        )
    os.replace(tmp, node.subnet_env)


@pytest.mark.netns
@pytest.mark.lab
def test_agent_lifecycle_with_a_stand_in(monkeypatch: pytest.MonkeyPatch) -> None:
    """Readiness, cni0, the status matrix and kill/start, with `sleep` as the agent.

    The real agent makes cni0 itself; a stand-in needs the lab's overlay_bridge."""
    monkeypatch.setattr(agents, "agent_argv", lambda state, node: ["sleep", "60"])
    with running_lab(nodes=2, backend="host-gw", start_agents=False, overlay_bridge=True) as lab:
        for i, node in enumerate(lab.nodes, start=1):
            lab.start_agent(node.name)
            _write_subnet_env(node, f"10.244.{i}.1/24")
            lab.wait_ready(node.name, timeout=5)
            assert topology.addresses(node.namespace, "cni0") == [IPv4Interface(f"10.244.{i}.1/24")]
        assert not lab.ping("n1", "n2")  # no overlay routes yet: what an agent would add
        n1, n2 = lab.node("n1"), lab.node("n2")
        lab.exec("n1", ["ip", "route", "add", "10.244.2.0/24", "via", str(n2.ip)])
        lab.exec("n2", ["ip", "route", "add", "10.244.1.0/24", "via", str(n1.ip)])
        doc = lab.status()
        assert doc["matrix"] == {"n1": {"n2": True}, "n2": {"n1": True}} and doc["ok"]
        assert [n["overlay_address"] for n in doc["nodes"]] == ["10.244.1.1/24", "10.244.2.1/24"]
        assert all(n["agent_running"] for n in doc["nodes"])
        # A stale subnet.env (older than the agent's start) does not count as ready.
        lab.kill_agent("n2", signal.SIGTERM)
        assert not procs.alive(agents.agent_ref(lab.node("n2")))
        lab.start_agent("n2")
        assert agents.check_ready(lab.node("n2")) is None
        _write_subnet_env(lab.node("n2"), "10.244.7.1/24")  # a new lease: cni0 follows
        lab.wait_ready("n2", timeout=5)
        assert topology.addresses(n2.namespace, "cni0") == [IPv4Interface("10.244.7.1/24")]
        # An agent that exits is reported with its log.
        lab.kill_agent("n2", signal.SIGKILL)
        lab.start_agent("n2")
        lab.kill_agent("n2", signal.SIGKILL)
        with pytest.raises(LabError, match="exited before writing"):
            lab.wait_ready("n2", timeout=5)


@pytest.mark.netns
@pytest.mark.lab
def test_failed_agent_start_reports_its_log_and_removes_the_lab(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    script = "import sys; print('cannot reach etcd', file=sys.stderr); sys.exit(3)"
    monkeypatch.setattr(agents, "agent_argv", lambda state, node: [sys.executable, "-c", script])
    before = host_snapshot()
    name = unique_lab_name()
    with pytest.raises(LabError, match=r"(?s)exited before writing.*cannot reach etcd"):
        Lab.up(name, nodes=2, timeout=10)
    assert lab_residue(before, host_snapshot(), name) == []
    assert name not in topology.list_netns() and not os.path.exists(f"{plan.LAB_ROOT}/{name}")


@pytest.mark.netns
@pytest.mark.lab
def test_down_removes_a_half_built_lab_and_up_refuses_leftovers() -> None:
    name = unique_lab_name()
    ns = f"fpl-{name}-n1"
    topology.add_namespace(ns)
    try:
        topology.ip(
            "link", "add", plan.host_link(name), "type", "veth", "peer", "name", "x", "netns", ns
        )
        with pytest.raises(LabError, match="exists already"):
            Lab.up(name, nodes=1, start_agents=False)
    finally:
        assert cli.main(["down", "--name", name]) == 0
    assert ns not in topology.list_netns()
    assert not topology.link_exists(plan.host_link(name))


@pytest.mark.netns
@pytest.mark.lab
def test_status_cli_json_without_agents(capsys: pytest.CaptureFixture[str]) -> None:
    with running_lab(nodes=2, start_agents=False) as lab:
        assert cli.main(["status", "--name", lab.name, "--json"]) == 1
        doc = json.loads(capsys.readouterr().out)
    assert doc["name"] == lab.name and doc["backend"] == "vxlan"
    assert doc["matrix"] == {"n1": {"n2": False}, "n2": {"n1": False}}
    assert doc["leases"] == [] and doc["etcd_error"] is None
    keys = {
        "name",
        "namespace",
        "underlay_iface",
        "underlay_address",
        "lease",
        "backend",
        "overlay_address",
        "segment",
    }
    assert all(keys <= set(n) for n in doc["nodes"])
    assert [n["underlay_iface"] for n in doc["nodes"]] == ["eth0", "eth0"]


def test_status_text_judges_every_family_the_lab_runs() -> None:
    ok = {"n1": {"n2": True}, "n2": {"n1": True}}
    half = {"n1": {"n2": True}, "n2": {"n1": False}}
    base = {"name": "x", "backend": "vxlan", "nodes": [], "leases": []}
    dual = status.render_text({**base, "matrix": ok, "matrix_ipv6": half})
    assert "IPv6 (over the IPv6 underlay)" in dual
    assert "node pairs that do not reach: 1 of 2 in IPv6" in dual
    both = status.render_text({**base, "matrix": ok, "matrix_ipv6": ok})
    assert "all 2 node pairs reach each other in both families" in both
    v6 = status.render_text(
        {**base, "matrix": None, "matrix_ipv6": half, "pod_matrix": None, "pod_matrix_ipv6": ok}
    )
    assert "1 of 2 node pairs do not reach in IPv6" in v6
    assert "all 2 pod pairs reach each other in IPv6" in v6
