"""IPv6-only in Kubernetes mode: two nodes of ours beside a real flanneld node with
``--kube-subnet-mgr``, against the lab's real kube-apiserver and kube-controller-manager
(``lab up --kube --ip-family ipv6 --flanneld-nodes 1``).

The node IPAM controller runs with an IPv6 ``--cluster-cidr`` alone and gives every Node
one IPv6 podCIDR; both sides publish Flannel's IPv6-only annotations (public-ipv6 and
backend-v6-data, no public-ip or backend-data); every node pair and pod pair reaches over
IPv6; a DF packet of our overlay MTU crosses between our pods and one byte more is
refused at the sender; and the doctor names the IPv6 MTU flanneld gets wrong.
"""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Iterator
from ipaddress import IPv6Network, ip_interface
from typing import Any

import pytest
from flannelpy_lab import Lab, plan, status, topology

from tests.support.lab_util import (
    lab_run_argv,
    nodes_json,
    print_agent_logs_if_failed,
    running_lab,
    wait_until,
)

pytestmark = [pytest.mark.lab]

PREFIX = "flannel.alpha.coreos.com/"
OURS, THEIRS = ("n1", "n2"), ("n3",)
V6_HEADERS = 48  # IPv6 + ICMPv6 headers: ping's payload = packet - 48
OUR_MTU = 1430  # VXLAN over IPv6 on a 1500-byte underlay: 1500 - 70


@pytest.fixture(scope="module")
def v6_lab() -> Iterator[Lab]:
    with running_lab(
        3,
        "vxlan",
        kube=True,
        flanneld_nodes=1,
        overlay_bridge=True,
        pods_per_node=1,
        net_conf_extra=plan.ip_family_net_conf("ipv6"),
    ) as lab:
        assert [n.agent_kind for n in lab.nodes] == ["flannelpy"] * 2 + ["flanneld"]
        yield lab


@pytest.fixture
def lab(request: pytest.FixtureRequest, v6_lab: Lab) -> Iterator[Lab]:
    """The module's lab; a failing test prints every node's log tail."""
    yield v6_lab
    print_agent_logs_if_failed(request, v6_lab)


def test_each_node_gets_one_ipv6_podcidr_and_only_ipv6_annotations(lab: Lab) -> None:
    network = IPv6Network(plan.DEFAULT_IPV6_NETWORK)
    nodes = nodes_json(lab)
    assert sorted(nodes) == ["n1", "n2", "n3"]
    for name, node in nodes.items():
        (cidr,) = node["spec"]["podCIDRs"]
        assert IPv6Network(cidr).subnet_of(network) and IPv6Network(cidr).prefixlen == 64
        notes = node["metadata"]["annotations"]
        assert notes[PREFIX + "kube-subnet-manager"] == "true", (name, notes)
        assert notes[PREFIX + "public-ipv6"] == plan.ipv6_underlay_ip(lab.node(name)), notes
        data = json.loads(notes[PREFIX + "backend-v6-data"])
        assert set(data) == {"VNI", "VtepMAC"}, (name, data)
        if name in OURS:  # as flanneld IPv6-only: no IPv4 annotations at all
            assert PREFIX + "public-ip" not in notes and PREFIX + "backend-data" not in notes


def test_every_node_pair_and_pod_pair_reaches_over_ipv6(lab: Lab) -> None:
    last: dict[str, Any] = {}

    def reaching() -> bool:
        last.update(lab.status())
        return bool(last["ok"])

    try:
        # flanneld's cni0 gets its IPv6 gateway with its first pod, and with DAD
        wait_until(reaching, 30.0, interval=1.0, what="every pair reaching over IPv6")
    except AssertionError as e:
        matrices = (last.get("matrix_ipv6"), last.get("pod_matrix_ipv6"))
        raise AssertionError(f"{e}: {matrices}") from e
    assert last["matrix"] is None and last["pod_matrix"] is None
    assert len(last["pod_matrix_ipv6"]) == 3 and status.all_reach(last["pod_matrix_ipv6"])


def test_df_at_our_mtu_crosses_and_one_more_is_refused(lab: Lab) -> None:
    pod = {p.node: p for p in lab.state.pods}
    dst = str(ip_interface(pod["n2"].address6 or "").ip)
    argv = ["ping", "-c", "1", "-W", "2", "-M", "do", "-s"]
    ok = topology.run_in(pod["n1"].namespace, [*argv, str(OUR_MTU - V6_HEADERS), dst], timeout=10)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    big = topology.run_in(
        pod["n1"].namespace, [*argv, str(OUR_MTU + 1 - V6_HEADERS), dst], timeout=10
    )
    out = big.stdout + big.stderr
    assert big.returncode != 0 and re.search(r"[Mm]essage too long|mtu ?= ?\d+", out), out


def test_the_doctor_finds_nothing_wrong_but_the_flanneld_peer_s_ipv6_mtu(lab: Lab) -> None:
    def run_doctor() -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            lab_run_argv(lab.name, "doctor", node="n1"), capture_output=True, text=True, timeout=60
        )

    # flanneld adds its VTEP address with duplicate address detection: it answers a
    # second or two after it starts, so wait for the doctor's peers line to be clean.
    last: list[subprocess.CompletedProcess[str]] = []
    wait_until(
        lambda: not last.append(run_doctor()) and "ERROR  peers" not in last[-1].stdout,
        30.0,
        interval=2.0,
        what="every peer answering the doctor",
    )
    doctor = last[-1]
    print(doctor.stdout)
    assert "ERROR" not in doctor.stdout, doctor.stdout + doctor.stderr
    assert "1 flanneld peer(s) run VXLAN over IPv6 with pod MTU 1450" in doctor.stdout, (
        doctor.stdout + doctor.stderr
    )
    assert f"only {OUR_MTU} fits" in doctor.stdout and "(n3)" in doctor.stdout
