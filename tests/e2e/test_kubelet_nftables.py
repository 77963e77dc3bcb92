"""The DaemonSet in nftables mode: the kubelet lab with ``EnableNFTables: true`` in the
ConfigMap's net-conf.json (``flannelpy-lab up --kubelet --enable-nftables``), kube-proxy
in nftables mode beside it, so each agent pod writes flannel's rules with the image's own
``nft`` and a node has no iptables rule of ours.

- every Node Ready, the agent pods and the test pods Running and Ready;
- every test pod reaches every other one (``kubectl exec ... ping``);
- on every node, flannel's tables in ``nft list ruleset`` (``ip flannel-ipv4`` and ``ip6
  flannel-ipv6``: kube-proxy's own tables are left aside) are the real flanneld's with the
  same net-conf.json, subnets aside. flanneld runs on a one-node ``--kube
  --flanneld-nodes 1 --enable-nftables`` lab beside this one, as Flannel's DaemonSet runs
  it (``--kube-subnet-mgr --ip-masq``): the kubelet lab's nodes all run our DaemonSet.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import pytest
from flannelpy_lab import Lab, kubelet
from flannelpy_lab import kube as control_plane

from tests.e2e.test_kubelet_cluster import AGENT_SELECTOR, items, unreachable_pairs, workload_pods
from tests.support.firewall_lab import in_ns
from tests.support.lab_util import running_lab, unique_lab_name

pytestmark = [pytest.mark.lab]

NODES = ("n1", "n2")
NFTABLES = {"EnableNFTables": True}
FLANNEL_TABLES = ("table ip flannel-ipv4", "table ip6 flannel-ipv6")


@pytest.fixture(scope="module")
def lab() -> Iterator[Lab]:
    lab = Lab.up(
        unique_lab_name("v"),
        len(NODES),
        kubelets=True,
        proxy_mode="nftables",
        net_conf_extra=NFTABLES,
        progress=print,
    )
    try:
        yield lab
    finally:
        lab.down()


@pytest.fixture(scope="module")
def flanneld_lab() -> Iterator[Lab]:
    with running_lab(
        1, kube=True, flanneld_nodes=1, net_conf_extra=NFTABLES, pods_per_node=0
    ) as lab:
        assert [n.agent_kind for n in lab.nodes] == ["flanneld"]
        yield lab


def net_conf(lab: Lab) -> dict[str, object]:
    (data,) = [
        c["data"]
        for c in items(lab, "configmaps", "-n", control_plane.NAMESPACE)
        if control_plane.NET_CONF_KEY in c.get("data", {})
    ]
    doc: dict[str, object] = json.loads(data[control_plane.NET_CONF_KEY])
    return doc


def flannel_tables(lab: Lab, node: str) -> str:
    """Flannel's tables of ``nft list ruleset`` in the node, its podCIDR written <subnet>."""
    ruleset = in_ns(lab.node(node).namespace, ["nft", "list", "ruleset"])
    tables = [t for t in re.split(r"(?m)^(?=table )", ruleset) if t.startswith(FLANNEL_TABLES)]
    (pod_cidr,) = [
        n["spec"]["podCIDR"] for n in items(lab, "nodes") if n["metadata"]["name"] == node
    ]
    return "".join(tables).replace(pod_cidr, "<subnet>")


def test_every_node_and_pod_is_ready(lab: Lab) -> None:
    assert net_conf(lab)["EnableNFTables"] is True
    nodes = items(lab, "nodes")
    assert sorted(n["metadata"]["name"] for n in nodes) == sorted(NODES)
    assert all(kubelet.node_ready(n) for n in nodes)
    agents = items(lab, "pods", "-n", control_plane.NAMESPACE, "-l", AGENT_SELECTOR)
    assert sorted(p["spec"]["nodeName"] for p in agents) == sorted(NODES)
    assert all(kubelet.pod_ready(p) for p in agents)
    pods = workload_pods(lab)
    assert sorted(p["spec"]["nodeName"] for p in pods) == sorted(NODES)
    assert all(kubelet.pod_ready(p) for p in pods)


def test_every_pod_pair_reaches(lab: Lab) -> None:
    pods = workload_pods(lab)
    assert len(pods) == len(NODES)
    assert unreachable_pairs(lab, pods) == []


def test_flannel_tables_are_flanneld_s_and_iptables_holds_none(lab: Lab, flanneld_lab: Lab) -> None:
    assert net_conf(flanneld_lab) == net_conf(lab)
    reference = flannel_tables(flanneld_lab, "n1")
    assert re.findall(r"(?m)^table .*(?= \{)", reference) == list(FLANNEL_TABLES)
    assert "masquerade" in reference
    for node in NODES:
        assert flannel_tables(lab, node) == reference, node
        saved = in_ns(lab.node(node).namespace, ["iptables-save"])
        assert "FLANNEL" not in saved and "flanneld masq" not in saved, node
