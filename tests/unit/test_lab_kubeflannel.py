"""Flannel as a kubelet lab's network (``flannelpy_lab.kubeflannel``): what kube-flannel.yml
deploys, rendered for the lab, and the lab requests that cannot run it."""

from __future__ import annotations

import json
from ipaddress import IPv4Network
from pathlib import Path

import pytest
from flannelpy_lab import kube as control_plane
from flannelpy_lab import kube_netpol, kubeflannel, plan
from flannelpy_lab.errors import LabError
from flannelpy_lab.lab import Lab
from flannelpy_lab.state import LabState

NET_CONF = plan.net_conf_json("10.161.0.0/16", "vxlan", False)


def lab_state() -> LabState:
    return plan.plan_lab(
        "fdu",
        2,
        "vxlan",
        direct_routing=False,
        segments=1,
        network="10.161.0.0/16",
        etcd_prefix=plan.DEFAULT_ETCD_PREFIX,
        subnets=[IPv4Network("100.64.9.0/24")],
        overlay_bridge=False,
        flanneld_nodes=2,
    )


def test_the_objects_are_kube_flannel_yml_but_the_daemonset() -> None:
    objects = kubeflannel.manifests(NET_CONF)
    assert [o["kind"] for o in objects] == [
        "Namespace",
        "ClusterRole",
        "ClusterRoleBinding",
        "ServiceAccount",
        "ConfigMap",
    ]
    by_kind = {o["kind"]: o for o in objects}
    namespace = by_kind["Namespace"]["metadata"]
    assert namespace["name"] == "kube-flannel"
    assert namespace["labels"]["pod-security.kubernetes.io/enforce"] == "privileged"
    # Flannel's ClusterRole, verb for verb: nothing more than flanneld asks for.
    granted = {
        (resource, verb)
        for rule in by_kind["ClusterRole"]["rules"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }
    assert granted == {
        ("pods", "get"),
        ("nodes", "get"),
        ("nodes", "list"),
        ("nodes", "watch"),
        ("nodes/status", "patch"),
    }
    assert by_kind["ClusterRoleBinding"]["subjects"] == [
        {"kind": "ServiceAccount", "name": "flannel", "namespace": "kube-flannel"}
    ]
    data = by_kind["ConfigMap"]["data"]
    assert data["net-conf.json"] == NET_CONF
    assert json.loads(data["cni-conf.json"]) == kubeflannel.CNI_CONF


def test_the_conflist_is_kube_flannel_ymls_unchanged(tmp_path: Path) -> None:
    kubeflannel.install_conflist(str(tmp_path))
    (written,) = tmp_path.iterdir()
    assert written.name == "10-flannel.conflist"
    assert json.loads(written.read_text()) == {
        "name": "cbr0",
        "cniVersion": "0.3.1",
        "plugins": [
            {"type": "flannel", "delegate": {"hairpinMode": True, "isDefaultGateway": True}},
            {"type": "portmap", "capabilities": {"portMappings": True}},
        ],
    }


def test_the_plugins_are_flannels_beside_the_reference_delegates(tmp_path: Path) -> None:
    reference, bin_dir = tmp_path / "reference", tmp_path / "bin"
    reference.mkdir()
    bin_dir.mkdir()
    for name in ("bridge", "host-local", "portmap", "macvlan"):
        (reference / name).write_text(name)
    flannel = tmp_path / "flannel-v0.9.1"
    flannel.write_text("flannel")
    state = lab_state()
    state.extra["flannel_cni_binary"] = str(flannel)
    kubeflannel.install_plugins(state, str(bin_dir), str(reference))
    installed = {p.name: p.read_text() for p in bin_dir.iterdir()}
    assert installed == {"flannel": "flannel", "bridge": "bridge", "host-local": "host-local"}


def test_flanneld_runs_as_the_daemonset_container_in_the_kubelets_namespaces() -> None:
    state = lab_state()
    n2 = state.node("n2")
    assert n2.runs_flanneld
    argv = kubeflannel.argv(state, n2, 4242, "/peers/flanneld")
    assert argv[:5] == ["nsenter", "--target=4242", "--mount", "--net", "/peers/flanneld"]
    flags = argv[5:]
    # The DaemonSet's arguments ...
    assert flags[:3] == ["--ip-masq", "--kube-subnet-mgr", "--healthz-port=8081"]
    # ... then only what a pod would have had otherwise; no --subnet-file: the default
    # /run/flannel/subnet.env is the node's own in its mount namespace.
    assert flags[3:] == [
        "--kubeconfig-file",
        "/run/flannelpy-lab/fdu/kube/flannel.kubeconfig",
        "--net-config-path",
        "/run/flannelpy-lab/fdu/kube/kube-flannel/net-conf.json",
        "--iface",
        "eth0",
    ]
    env = kubeflannel.environ(n2)
    assert env["NODE_NAME"] == "n2"
    assert (env["POD_NAMESPACE"], env["EVENT_QUEUE_DEPTH"], env["CONT_WHEN_CACHE_NOT_READY"]) == (
        "kube-flannel",
        "5000",
        "false",
    )


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"network_agent": "flanneld"}, "--network-agent flanneld needs --kubelet"),
        ({"network_agent": "calico", "kubelets": True}, "--network-agent 'calico' is unknown"),
        ({"kubelets": True, "flanneld_nodes": 1}, "use --network-agent flanneld"),
    ],
)
def test_a_lab_flannel_cannot_run_is_refused_before_anything_is_built(
    tmp_path: Path, options: dict[str, object], message: str
) -> None:
    with pytest.raises(LabError, match=message) as caught:
        Lab.up("unit", 2, lab_root=str(tmp_path / "labs"), **options)  # type: ignore[arg-type]
    assert "\n" not in str(caught.value)
    assert not (tmp_path / "labs").exists()


def test_network_policy_on_flannel_is_kube_network_policies_beside_flanneld() -> None:
    # Accepted: every node runs kube-network-policies as Flannel's chart adds it.
    kubeflannel.validate("flanneld", True, 0)
    objects = kube_netpol.cluster_role_objects()
    # kube-flannel.yml's Namespace and ServiceAccount are the lab's already: applied again
    # without their labels, the Namespace would lose pod-security's "privileged".
    assert [o["kind"] for o in objects] == ["ClusterRole", "ClusterRoleBinding"]
    binding = objects[1]
    assert binding["subjects"] == [
        {
            "kind": "ServiceAccount",
            "name": kubeflannel.SERVICE_ACCOUNT,
            "namespace": kubeflannel.NAMESPACE,
        }
    ]
    state = lab_state()
    state.extra[kube_netpol.BINARY_KEY] = "/peers/kube-network-policies"
    control_plane.record(state)[control_plane.KUBELETS_KEY] = True
    assert not kube_netpol.enabled(state)
    state.extra[control_plane.NETWORK_POLICY_KEY] = True
    # On from the start: a kubelet lab's control plane registers no Nodes itself.
    assert kube_netpol.enabled(state)
    n1 = state.node("n1")
    # In the namespace the node's kubelet and flanneld run in (/run/netns/<namespace>).
    assert kube_netpol.argv(state, n1)[:4] == ["ip", "netns", "exec", n1.namespace]
