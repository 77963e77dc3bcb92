"""Dual stack in Kubernetes mode: two nodes of ours beside two real flanneld nodes with
``--kube-subnet-mgr``, against the lab's real kube-apiserver and kube-controller-manager
(``lab up --kube --ip-family dual --flanneld-nodes 2``).

The node IPAM controller runs with a dual ``--cluster-cidr`` and gives every Node an IPv4
and an IPv6 podCIDR; both sides publish Flannel's dual-stack annotations (public-ipv6,
backend-v6-data); every node pair and pod pair reaches in both families; and the IPv6
MTU flanneld gets wrong (it subtracts 50 for VXLAN over an IPv6 underlay, which costs 70)
shows in real packets, in our prober's metrics and in ``flannelpy doctor``.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from ipaddress import IPv4Network, IPv6Network, ip_interface
from pathlib import Path

import pytest
from flannelpy_lab import Lab, plan, status, topology
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from tests.support.lab_util import (
    lab_run_argv,
    nodes_json,
    print_agent_logs_if_failed,
    running_lab,
    wait_until,
)

pytestmark = [pytest.mark.lab]

PREFIX = "flannel.alpha.coreos.com/"
OURS, THEIRS = ("n1", "n2"), ("n3", "n4")
CONVERGE = 30.0  # seconds for every pair to reach in both families
V6_HEADERS = 48  # IPv6 + ICMPv6 headers: ping's payload = packet - 48
OUR_MTU, FLANNELD_MTU = 1430, 1450  # VXLAN over IPv6 on a 1500-byte underlay: 70 vs 50
METRICS_URL = "http://127.0.0.1:9403/metrics"  # the agent's default --metrics-addr
_GET = (
    "import sys, urllib.request\n"
    "opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))\n"
    "sys.stdout.write(opener.open(sys.argv[1], timeout=5).read().decode())"
)


@pytest.fixture(scope="module")
def dual_lab() -> Iterator[Lab]:
    with running_lab(
        4,
        "vxlan",
        kube=True,
        flanneld_nodes=2,
        overlay_bridge=True,
        pods_per_node=1,
        net_conf_extra=plan.ip_family_net_conf("dual"),
    ) as lab:
        assert [n.agent_kind for n in lab.nodes] == ["flannelpy"] * 2 + ["flanneld"] * 2
        yield lab


@pytest.fixture
def lab(request: pytest.FixtureRequest, dual_lab: Lab) -> Iterator[Lab]:
    """The module's lab; a failing test prints every node's log tail."""
    yield dual_lab
    print_agent_logs_if_failed(request, dual_lab)


def subnet_env(lab: Lab, name: str) -> dict[str, str]:
    text = Path(lab.node(name).subnet_env).read_text(encoding="ascii")
    return dict(line.split("=", 1) for line in text.split())


def test_each_node_gets_a_podcidr_of_each_family_and_both_sides_annotate_both(
    lab: Lab,
) -> None:
    nodes = nodes_json(lab)
    assert sorted(nodes) == ["n1", "n2", "n3", "n4"]
    for name, node in nodes.items():
        v4, v6 = node["spec"]["podCIDRs"]
        assert IPv4Network(v4).subnet_of(IPv4Network("10.244.0.0/16")), (name, v4)
        assert IPv4Network(v4).prefixlen == 24
        assert IPv6Network(v6).subnet_of(IPv6Network(plan.DEFAULT_IPV6_NETWORK)), (name, v6)
        assert IPv6Network(v6).prefixlen == 64
        notes = node["metadata"]["annotations"]
        info = lab.node(name)
        assert notes[PREFIX + "public-ip"] == str(info.ip), (name, notes)
        assert notes[PREFIX + "public-ipv6"] == plan.ipv6_underlay_ip(info), (name, notes)
        v6_data = json.loads(notes[PREFIX + "backend-v6-data"])
        link = json.loads(lab.exec(name, ["ip", "-j", "link", "show", "flannel-v6.1"]).stdout)
        assert v6_data == {"VNI": 1, "VtepMAC": link[0]["address"]}, (name, v6_data)
        # flanneld gives each VTEP its own MAC; so do we (before, flannel-v6.1 had ours
        # of flannel.1).
        v4_data = json.loads(notes[PREFIX + "backend-data"])
        link4 = json.loads(lab.exec(name, ["ip", "-j", "link", "show", "flannel.1"]).stdout)
        assert v4_data["VtepMAC"] == link4[0]["address"] != link[0]["address"], (name, notes)
        # Each side's subnet.env holds the Node's two podCIDRs.
        env = subnet_env(lab, name)
        assert IPv4Network(env["FLANNEL_SUBNET"], strict=False) == IPv4Network(v4)
        assert IPv6Network(env["FLANNEL_IPV6_SUBNET"], strict=False) == IPv6Network(v6)
        assert env["FLANNEL_IPV6_NETWORK"] == plan.DEFAULT_IPV6_NETWORK
    for name in OURS:
        assert subnet_env(lab, name)["FLANNEL_MTU"] == str(OUR_MTU)
    for name in THEIRS:  # flanneld subtracts 50 for VXLAN whatever the family
        assert subnet_env(lab, name)["FLANNEL_MTU"] == str(FLANNELD_MTU)
        assert PREFIX + "flannelpy-mtu" not in nodes[name]["metadata"]["annotations"]


def test_every_node_pair_and_pod_pair_reaches_in_both_families(lab: Lab) -> None:
    keys = ("matrix", "matrix_ipv6", "pod_matrix", "pod_matrix_ipv6")

    def reaching() -> bool:
        doc = lab.status()
        return all(doc.get(k) and status.all_reach(doc[k]) for k in keys)

    wait_until(reaching, timeout=CONVERGE, interval=1.0, what="every pair in both families")
    doc = lab.status()
    for key in keys:
        pairs = [ok for row in doc[key].values() for ok in row.values()]
        assert len(pairs) == 4 * 3 and all(pairs), (key, doc[key])
    assert all(p.address and p.address6 for p in lab.state.pods), lab.state.pods


def samples(lab: Lab, node: str) -> list[Sample]:
    """Every sample of the node's agent's /metrics (read inside its namespace)."""
    body = lab.exec(node, [sys.executable, "-c", _GET, METRICS_URL]).stdout
    return [s for family in text_string_to_metric_families(body) for s in family.samples]


def df_ping6(ns: str, dst: str, packet: int) -> tuple[bool, str]:
    """One DF IPv6 ping of ``packet`` bytes on the wire."""
    argv = ["ping", "-c", "1", "-W", "2", "-M", "do", "-s", str(packet - V6_HEADERS), dst]
    proc = topology.run_in(ns, argv, timeout=10)
    return proc.returncode == 0, proc.stdout + proc.stderr


def test_flanneld_ipv6_mtu_is_wrong_in_packets_and_named_by_prober_and_doctor(
    lab: Lab,
) -> None:
    pod = {p.node: p for p in lab.state.pods}
    ours6 = str(ip_interface(pod["n1"].address6 or "").ip)
    # The real consequence: a flanneld pod's full-size (1450) IPv6 packet does not fit
    # VXLAN over IPv6 and is refused by its own VTEP; 1430 crosses.
    ok, out = df_ping6(pod["n3"].namespace, ours6, OUR_MTU)
    assert ok, out
    ok, out = df_ping6(pod["n3"].namespace, ours6, FLANNELD_MTU)
    assert not ok and re.search(r"[Pp]acket too big|[Mm]essage too long|mtu ?= ?\d+", out), out
    # Our prober: a DF probe of our MTU reaches every peer in each family (metrics by
    # family label), and the 2 flanneld peers advertise no MTU of their own.
    prefix6 = {
        str(IPv6Network(n["spec"]["podCIDRs"][1])): name for name, n in nodes_json(lab).items()
    }

    def verified() -> dict[tuple[str, str], float]:
        return {
            (s.labels["family"], s.labels["peer"]): s.value
            for s in samples(lab, "n1")
            if s.name == "flannelpy_peer_path_mtu_verified"
        }

    # NaN until a peer's first probe passed (flanneld's VTEP address is tentative for a
    # second or two after it starts).
    wait_until(
        lambda: list(verified().values()) == [1.0] * 6,
        timeout=CONVERGE,
        interval=1.0,
        what="the prober verifying 3 peers in 2 families",
    )
    found = verified()
    assert all(v == 1.0 for v in found.values()), found
    assert {prefix6[p] for f, p in found if f == "ipv6"} == {"n2", "n3", "n4"}, found
    gauges = {s.name: s.value for s in samples(lab, "n1") if not s.labels}
    assert gauges["flannelpy_peers_mtu_unknown"] == 2.0, gauges
    assert gauges["flannelpy_overlay_mtu_bytes"] == OUR_MTU, gauges
    doctor = subprocess.run(
        lab_run_argv(lab.name, "doctor", node="n1"), capture_output=True, text=True, timeout=60
    )
    print(doctor.stdout)
    assert f"2 flanneld peer(s) run VXLAN over IPv6 with pod MTU {FLANNELD_MTU}" in doctor.stdout, (
        doctor.stdout + doctor.stderr
    )
    assert f"only {OUR_MTU} fits" in doctor.stdout
    assert "(n3, n4)" in doctor.stdout
