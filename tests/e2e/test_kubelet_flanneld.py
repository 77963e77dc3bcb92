"""Flannel itself as a kubelet lab's network: the reference cluster of the upstream e2e specs.

``Lab.up(..., kubelets=True, network_agent="flanneld")`` (``flannelpy-lab up --kubelet
--network-agent flanneld``) runs the same cluster as the flannelpy kubelet lab, with the
pinned flanneld (``--kube-subnet-mgr``) on every node and Flannel's CNI plugin making the
pods (``flannelpy_lab.kubeflannel``). Two nodes: a pod on n1 calls an ``httpd`` pod on n2
that answers its own name and the client address it saw, so every answer shows the
request crossed the overlay from the client's own address, and n2's VXLAN device counts
the packets that arrived through it.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Iterator

import pytest
from flannelpy_lab import Lab, kubeflannel, kubelet
from flannelpy_lab import kube as control_plane

from tests.support import kube_services as ks
from tests.support.lab_util import unique_lab_name, wait_until

pytestmark = [pytest.mark.lab]

NODES = ("n1", "n2")
COUNT = 10  # requests from the pod on n1 to the pod on n2
VTEP = "flannel.1"  # Flannel's VXLAN device name, VNI 1


@pytest.fixture(scope="module")
def lab() -> Iterator[Lab]:
    t0 = time.monotonic()
    lab = Lab.up(
        unique_lab_name("fd"), len(NODES), kubelets=True, network_agent="flanneld", progress=print
    )
    print(f"lab up in {time.monotonic() - t0:.1f} s")
    try:
        yield lab
    finally:
        t1 = time.monotonic()
        lab.down()
        print(f"lab down in {time.monotonic() - t1:.1f} s")


def rx_packets(lab: Lab, node: str, device: str) -> int:
    doc = json.loads(lab.exec(node, ["ip", "-s", "-j", "link", "show", device]).stdout)
    packets: int = doc[0]["stats64"]["rx"]["packets"]
    return packets


def test_flanneld_is_the_network_of_every_node(lab: Lab) -> None:
    nodes = {n["metadata"]["name"]: n for n in ks.items(lab, "nodes")}
    assert set(nodes) == set(NODES)
    for name, node in nodes.items():
        info = lab.node(name)
        assert kubelet.node_ready(node), node["status"]["conditions"]
        annotations = node["metadata"]["annotations"]
        assert annotations["flannel.alpha.coreos.com/public-ip"] == str(info.ip)
        assert annotations["flannel.alpha.coreos.com/backend-type"] == "vxlan"
        # flanneld, not the lab, reported the network up on the Node.
        conditions = {c["type"]: c for c in node["status"]["conditions"]}
        assert conditions["NetworkUnavailable"]["reason"] == "FlannelIsUp"
        # The pinned flanneld runs in the node's namespace, with its lease in subnet.env.
        with open(f"/proc/{info.agent_pid}/cmdline", "rb") as f:
            cmdline = f.read().split(b"\0")
        assert os.path.basename(cmdline[0].decode()) == "flanneld", cmdline
        assert b"--kube-subnet-mgr" in cmdline
        netns = os.stat(f"/proc/{info.agent_pid}/ns/net")
        assert netns.st_ino == os.stat(f"/run/netns/{info.namespace}").st_ino
        subnet_env = os.path.join(kubelet.host_source(info, "/run/flannel"), "subnet.env")
        with open(subnet_env, encoding="utf-8") as f:
            lease = f.read()
        assert f"FLANNEL_SUBNET={node['spec']['podCIDR'].replace('.0/', '.1/')}" in lease
        conf_dir = kubelet.host_source(info, "/etc/cni/net.d")
        assert os.listdir(conf_dir) == [kubeflannel.CONFLIST_FILE]
    # No flannelpy DaemonSet: the lab applied kube-flannel.yml's objects instead.
    assert not ks.items(lab, "daemonsets", "-A")
    accounts = ks.items(lab, "serviceaccounts", "-n", kubeflannel.NAMESPACE)
    assert kubeflannel.SERVICE_ACCOUNT in {a["metadata"]["name"] for a in accounts}
    assert control_plane.NAMESPACE not in {
        n["metadata"]["name"] for n in ks.items(lab, "namespaces")
    }


def test_a_pod_on_n1_reaches_a_pod_on_n2_from_its_own_address(lab: Lab) -> None:
    doc = {"apiVersion": "v1", "kind": "List", "items": [ks.backend("n2")]}
    lab.kubectl("apply", "-f", "-", stdin=json.dumps(doc))

    def backend_ready() -> bool:
        pods = ks.items(lab, "pods", "-l", "app=web")
        return len(pods) == 1 and kubelet.pod_ready(pods[0])

    wait_until(backend_ready, timeout=90, interval=0.5, what="web-n2 ready")
    (web,) = ks.items(lab, "pods", "-l", "app=web")
    clients = {
        p["spec"]["nodeName"]: p
        for p in ks.items(lab, "pods", "-l", f"app={kubelet.WORKLOAD}")
        if p["status"].get("phase") == "Running"
    }
    client = clients["n1"]
    client_ip, web_ip = client["status"]["podIP"], web["status"]["podIP"]
    pod_cidrs = {n["metadata"]["name"]: n["spec"]["podCIDR"] for n in ks.items(lab, "nodes")}
    assert pod_cidrs["n1"] != pod_cidrs["n2"]
    # The pod's address is Flannel's CNI plugin's: host-local's reservation on n2.
    reserved = os.path.join(kubelet.host_source(lab.node("n2"), "/var/lib/cni"), "networks")
    assert os.path.exists(os.path.join(reserved, "cbr0", web_ip)), os.listdir(reserved)
    before = rx_packets(lab, "n2", VTEP)
    url = f"http://{web_ip}:{ks.PORT}{ks.PATH}"
    answers = ks.from_pod(lab, client["metadata"]["name"], url, COUNT)
    arrived = rx_packets(lab, "n2", VTEP) - before
    print(f"from {client_ip} on n1 to {web_ip} on n2: {answers.summary()}; {arrived} in")
    assert answers.answered == COUNT, answers.summary()
    assert answers.backends == {"web-n2"}, answers.summary()
    assert answers.sources == {client_ip}, f"the client's address was translated: {answers}"
    # Each request is a TCP conversation: at least three segments in from n1 per request.
    assert arrived >= 3 * COUNT, arrived


def test_status_reports_flanneld_as_each_nodes_agent(lab: Lab) -> None:
    doc = lab.status()
    assert doc["store"] == "kubernetes" and doc["agent_error"] is None
    for node in doc["nodes"]:
        assert node["agent_kind"] == "flanneld", node
        assert node["agent_running"] and node["agent_pod"] is None, node
        assert re.fullmatch(r"10\.244\.\d+\.0/24", node["lease"] or ""), node
    assert doc["ok"], (doc["matrix"], doc["pod_matrix"])
