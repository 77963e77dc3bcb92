"""kube-network-policies as Flannel's chart runs it beside flanneld in the lab: its
arguments, its in-cluster environment and its permissions (no namespaces; one test runs the
in-cluster wrapper in a private mount namespace, as root)."""

from __future__ import annotations

import os
import subprocess
from ipaddress import IPv4Network
from pathlib import Path

import pytest
from flannelpy_lab import kube_netpol, plan
from flannelpy_lab.state import LabState


def make_state(tmp_path: Path) -> LabState:
    state = plan.plan_lab(
        "unit", 2, "vxlan", direct_routing=False, segments=1, network="10.244.0.0/16",
        etcd_prefix="/coreos.com/network", subnets=[IPv4Network("100.64.9.0/24")],
        overlay_bridge=False, lab_root=str(tmp_path), flanneld_nodes=2,
    )  # fmt: skip
    state.extra[kube_netpol.BINARY_KEY] = "/peers/kube-network-policies"
    return state


def test_runs_with_the_charts_arguments_in_the_node_namespace(tmp_path: Path) -> None:
    state = make_state(tmp_path)
    node = state.nodes[0]
    argv = kube_netpol.argv(state, node)
    assert argv[:4] == ["ip", "netns", "exec", node.namespace]
    # The chart passes these two and nothing else: v0.8.0's defaults hold (fail-open off).
    assert argv[-3:] == ["/peers/kube-network-policies", f"--hostname-override={node.name}",
                         "--v=2"]  # fmt: skip
    assert kube_netpol.secrets_dir(node) in argv
    assert "unshare" in argv


def test_environment_is_a_pods_in_cluster_one(tmp_path: Path) -> None:
    state = make_state(tmp_path)
    state.host_address = "100.64.9.254/24"
    env = kube_netpol.environ(state, state.nodes[1])
    assert env["KUBERNETES_SERVICE_HOST"] == "100.64.9.254"
    assert env["KUBERNETES_SERVICE_PORT"] == "6443"
    assert env["MY_NODE_NAME"] == state.nodes[1].name


def test_cluster_role_lets_it_watch_what_it_reads() -> None:
    role = next(o for o in kube_netpol.rbac_objects() if o["kind"] == "ClusterRole")
    granted = {(g, r, v) for rule in role["rules"] for g in rule["apiGroups"]
               for r in rule["resources"] for v in rule["verbs"]}  # fmt: skip
    for group, resource in (("", "pods"), ("", "namespaces"),
                            ("networking.k8s.io", "networkpolicies")):  # fmt: skip
        assert {(group, resource, "list"), (group, resource, "watch")} <= granted


@pytest.mark.skipif(os.geteuid() != 0, reason="a mount namespace needs root")
def test_in_cluster_files_are_where_client_go_reads_them(tmp_path: Path) -> None:
    src = tmp_path / "secrets"
    src.mkdir()
    (src / "token").write_text("tok")
    (src / "ca.crt").write_text("-----BEGIN CERTIFICATE-----\nx\n-----END CERTIFICATE-----\n")
    (src / "namespace").write_text("kube-flannel")
    show = f"cd {kube_netpol.SECRETS} && cat token; echo; cat ca.crt namespace"
    wrapper = ["sh", "-c", kube_netpol.IN_CLUSTER, "sh", str(src)]
    argv = ["unshare", "--mount", "--propagation", "private", *wrapper, "sh", "-c", show]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=True).stdout
    assert out.splitlines() == ["tok", "-----BEGIN CERTIFICATE-----", "x",
                                "-----END CERTIFICATE-----", "kube-flannel"]  # fmt: skip
