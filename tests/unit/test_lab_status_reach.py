"""``lab status`` on every kind of lab: probe points, judged matrices, the kubelet lab's
agents, and kube-proxy's settings (pure parts; the e2e tier runs them on labs)."""

from __future__ import annotations

import argparse
from ipaddress import IPv4Network, IPv6Network
from pathlib import Path
from typing import Any

import pytest
from flannelpy_lab import cli, kube, kubelet, proxy, reach, status
from flannelpy_lab.errors import LabError
from flannelpy_lab.lab import Lab

from tests.unit.test_lab_agents import make_lab

LEASE = IPv4Network("10.244.3.0/24")


def link(name: str, operstate: str, flags: list[str], *addresses: str) -> dict[str, Any]:
    return {
        "ifname": name,
        "operstate": operstate,
        "flags": flags,
        "addr_info": [
            {"local": a.split("/")[0], "prefixlen": int(a.split("/")[1])} for a in addresses
        ],
    }


UP = ["BROADCAST", "MULTICAST", "UP", "LOWER_UP"]
NO_CARRIER = ["NO-CARRIER", "BROADCAST", "MULTICAST", "UP"]
VTEP = link("flannel.1", "UNKNOWN", UP, "10.244.3.0/32")


def test_an_up_bridge_is_the_probe_point() -> None:
    links = [link("eth0", "UP", UP, "100.64.0.3/24"), VTEP, link("cni0", "UP", UP, "10.244.3.1/24")]
    assert reach.pick(links, LEASE) == reach.ProbePoint("cni0", "10.244.3.1")


def test_a_bridge_without_ports_or_missing_leaves_the_vtep() -> None:
    down = link("cni0", "DOWN", NO_CARRIER, "10.244.3.1/24")
    assert reach.pick([down, VTEP], LEASE) == reach.ProbePoint("flannel.1", "10.244.3.0")
    assert reach.pick([VTEP], LEASE) == reach.ProbePoint("flannel.1", "10.244.3.0")
    assert reach.pick([VTEP], LEASE).describe() == "flannel.1 10.244.3.0 (backend device)"


def test_without_an_up_device_in_the_lease_there_is_no_probe_point() -> None:
    down = link("cni0", "DOWN", NO_CARRIER, "10.244.3.1/24")
    other = link("flannel.1", "UNKNOWN", UP, "10.244.9.0/32")  # another lease
    assert reach.pick([down, other], LEASE) == reach.ProbePoint()
    assert reach.pick([VTEP], None) == reach.ProbePoint()
    assert reach.ProbePoint().describe().startswith("no lease address up")


def test_the_ipv6_lease_picks_ipv6_addresses() -> None:
    lease6 = IPv6Network("fd10:244:0:3::/64")
    vtep6 = link("flannel-v6.1", "UNKNOWN", UP, "fd10:244:0:3::/128")
    assert reach.pick([VTEP, vtep6], lease6) == reach.ProbePoint("flannel-v6.1", "fd10:244:0:3::")


def test_the_matrix_marks_pairs_judged_by_routes() -> None:
    matrix = {"n1": {"n2": True, "n3": False}, "n2": {"n1": True, "n3": True}, "n3": {}}
    how = {"n1": {"n2": "route", "n3": "route"}, "n2": {"n1": "ping", "n3": "ping"}}
    text = status.render_matrix(matrix, how)
    assert text[1] == "n1  .   rt  --"
    assert text[2] == "n2  ok  .   ok"


def kubelet_doc() -> dict[str, Any]:
    node = {
        "name": "n1",
        "namespace": "fpl-x-n1",
        "segment": 1,
        "underlay_iface": "eth0",
        "underlay_address": "100.64.0.1/24",
        "lease": "10.244.1.0/24",
        "backend": "vxlan",
        "overlay_address": "10.244.1.1/24",
        "agent_kind": "flannelpy",
        "agent_pid": None,
        "agent_running": False,
        "agent_pod": {"name": "kube-flannelpy-ds-abcde", "phase": "Pending", "ready": False},
        "pods": [],
    }
    lease = {
        "key": "n1",
        "subnet": "10.244.1.0/24",
        "public_ip": "100.64.0.1",
        "backend": "vxlan",
        "node_name": "n1",
    }
    return {
        "name": "x",
        "backend": "vxlan",
        "network": "10.244.0.0/16",
        "store": "kubernetes",
        "kube_api_url": "https://100.64.0.254:6443",
        "nodes": [node],
        "leases": [lease],
        "matrix": {"n1": {}},
        "probe_points": {"n1": "cni0 10.244.1.1 (bridge)"},
    }


def test_the_kubelet_lab_shows_the_daemonset_pod_and_the_nodes_leases() -> None:
    text = status.render_text(kubelet_doc())
    assert "Kubernetes API https://100.64.0.254:6443" in text and "etcd" not in text
    assert "pod kube-flannelpy-ds-abcde (Pending, not ready)" in text
    assert "leases on the Nodes: 1" in text
    assert "n1: cni0 10.244.1.1 (bridge)" in text


def test_kube_proxy_gets_its_mode_and_a_conntrack_it_can_set_in_a_namespace() -> None:
    doc = proxy.proxy_config("nftables", "n2", "100.64.0.2", "/k/kp.kubeconfig", "10.244.0.0/16")
    assert doc["kind"] == "KubeProxyConfiguration" and doc["mode"] == "nftables"
    assert doc["conntrack"] == {"maxPerCore": 0, "min": 0}
    assert doc["hostnameOverride"] == "n2" and doc["clusterCIDR"] == "10.244.0.0/16"
    assert doc["healthzBindAddress"] == "100.64.0.2:10256"
    assert doc["clientConnection"] == {"kubeconfig": "/k/kp.kubeconfig"}


def test_the_proxy_mode_flag(tmp_path: Path) -> None:
    parser = cli.build_parser()
    args = parser.parse_args(["up", "--name", "a", "--kubelet", "--proxy-mode", "nftables"])
    assert isinstance(args, argparse.Namespace) and args.proxy_mode == "nftables"
    assert parser.parse_args(["up", "--name", "a", "--kubelet"]).proxy_mode == "iptables"
    with pytest.raises(SystemExit):
        parser.parse_args(["up", "--name", "a", "--kubelet", "--proxy-mode", "ipvs"])
    # Without kubelets there is no kube-proxy to put in a mode: refused before anything.
    with pytest.raises(LabError, match="--proxy-mode needs --kubelet"):
        Lab.up("unit", 2, kube=True, proxy_mode="nftables", lab_root=str(tmp_path / "labs"))
    assert not (tmp_path / "labs").exists()


def test_up_names_kubectl_and_the_proxy_mode_of_a_kubelet_lab(tmp_path: Path) -> None:
    state = make_lab(tmp_path).state
    state.extra[kube.STATE_KEY] = {kube.KUBELETS_KEY: True}
    state.extra[kubelet.STATE_KEY] = {"proxy_mode": "nftables"}
    text = cli.summary(state)
    assert f"kubectl --kubeconfig {kube.admin_kubeconfig(state)} get nodes" in text
    assert "kube-proxy (nftables mode) on every node" in text
