"""The lab's flanneld nodes in Kubernetes mode (``lab up --kube --flanneld-nodes K``): the
command line and environment flanneld gets, and how the lab reads a lease off a Node.
Pure: neither root nor the binaries are needed."""

from __future__ import annotations

from ipaddress import IPv4Network
from pathlib import Path

import pytest
from flannelpy_lab import agents, flanneld, plan
from flannelpy_lab import kube as control_plane
from flannelpy_lab.state import LabState

P = "flannel.alpha.coreos.com/"


def mixed_state(tmp_path: Path, kube: bool) -> LabState:
    state = plan.plan_lab(
        "unit",
        4,
        "vxlan",
        direct_routing=False,
        segments=1,
        network="10.244.0.0/16",
        etcd_prefix="/coreos.com/network",
        subnets=[IPv4Network("100.64.9.0/24")],
        overlay_bridge=False,
        lab_root=str(tmp_path),
        flanneld_nodes=2,
    )
    state.extra["flanneld_binary"] = "/opt/flanneld"
    if kube:
        state.extra["kube_api_url"] = control_plane.api_url(state)
        state.extra["kube_kubeconfig"] = control_plane.agent_kubeconfig(state)
    return state


def flags(argv: list[str]) -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for i, arg in enumerate(argv[1:], start=1):
        if arg.startswith("-"):
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            out[arg] = None if nxt is None or nxt.startswith("-") else nxt
    return out


def test_flanneld_in_kube_mode_runs_as_flannels_daemonset_does(tmp_path: Path) -> None:
    state = mixed_state(tmp_path, kube=True)
    node = state.nodes[3]
    assert node.runs_flanneld
    got = flags(flanneld.argv(state, node))
    assert "--kube-subnet-mgr" in got
    assert got["--kubeconfig-file"] == control_plane.agent_kubeconfig(state)
    assert got["--net-config-path"] == agents.kube_net_conf_path(state)
    assert got["--iface"] == node.underlay_iface
    assert got["--subnet-file"] == node.subnet_env
    assert not any(f.startswith("--etcd") for f in got)


def test_flanneld_in_etcd_mode_is_unchanged(tmp_path: Path) -> None:
    state = mixed_state(tmp_path, kube=False)
    got = flags(flanneld.argv(state, state.nodes[3]))
    assert got["--etcd-endpoints"] == ",".join(state.etcd_endpoints)
    assert "--kube-subnet-mgr" not in got and "--kubeconfig-file" not in got


def test_flanneld_environment_drops_proxies_and_adds_the_daemonsets(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.example:3128")
    monkeypatch.setenv("no_proxy", "localhost")
    env = flanneld.environ(mixed_state(tmp_path, kube=True))
    assert "HTTPS_PROXY" not in env and "no_proxy" not in env
    assert env["POD_NAMESPACE"] == control_plane.NAMESPACE
    assert (env["EVENT_QUEUE_DEPTH"], env["CONT_WHEN_CACHE_NOT_READY"]) == ("5000", "false")
    assert "POD_NAMESPACE" not in flanneld.environ(mixed_state(tmp_path, kube=False))


def node(annotations: dict[str, str] | None, pod_cidr: str | None) -> dict[str, object]:
    return {
        "metadata": {"name": "n3", **({"annotations": annotations} if annotations else {})},
        "spec": {"podCIDR": pod_cidr} if pod_cidr else {},
    }


def test_a_node_is_a_lease_once_it_has_a_pod_cidr_and_flannels_public_ip() -> None:
    notes = {P + "public-ip": "100.64.9.3", P + "backend-type": "vxlan"}
    assert control_plane.node_lease(node(notes, "10.244.2.0/24")) == {
        "key": "n3",
        "subnet": "10.244.2.0/24",
        "public_ip": "100.64.9.3",
        "public_ipv6": None,
        "backend": "vxlan",
        "node_name": "n3",
        "error": None,
    }
    # IPv6-only, Flannel writes the IPv6 annotations alone
    v6 = {P + "public-ipv6": "fd00:64:1::3", P + "backend-type": "vxlan"}
    lease6 = control_plane.node_lease(node(v6, "fd10:244:0:2::/64"))
    assert lease6 is not None and (lease6["public_ip"], lease6["public_ipv6"]) == (
        None,
        "fd00:64:1::3",
    )
    assert control_plane.node_lease(node(notes, None)) is None
    assert control_plane.node_lease(node(None, "10.244.2.0/24")) is None
    assert control_plane.node_lease({}) is None


def test_registered_nodes_carry_an_annotation_as_a_kubelet_s_do() -> None:
    # flanneld v0.28.9 panics writing its annotations on a Node that has none.
    assert control_plane.node_manifest("n1", "100.64.9.1")["metadata"]["annotations"]
